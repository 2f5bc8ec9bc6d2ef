"""The monolithic baseline: the whole model's generate() in a worker process, timed token by token, and its handle.

It can also time hearth's own one-process path (inference.local.LocalModel: the shards' runner over every layer
plus the orchestrator's head), loaded on the first such job; for a GGUF that path is the baseline itself (see
MonolithicModel). The worker is ``python -m hearth.services.devtools.bench PATH [THREADS]``
(hearth/services/devtools/bench/__main__.py); it answers MonolithicJob lines on stdin with MonolithicReply lines on
stdout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from hearth.formats.gguf_support import is_gguf_file
from hearth.protocol.quantization_labels import AUTO_QUANTIZATION
from hearth.services.common.hearth_files import SOURCES_ROOT
from hearth.services.devtools.bench.errors import BenchError
from hearth.services.devtools.bench.prompts import build_prompt
from hearth.services.devtools.bench.timing import GenerationTiming

# Which one-process path a worker times as its baseline: transformers' generate() over the checkpoint, or hearth's
# own (LocalModel), the one a GGUF gets.
BaselinePath = Literal["generate", "hearth_local"]


class MonolithicJob(BaseModel):
    """One request to the monolithic worker (a JSON line on its stdin)."""

    # generate: transformers generate(); generate_local: hearth's LocalModel, the same runner code the shards run.
    kind: Literal["prompt", "generate", "generate_local"]
    prompt_tokens: int = 0
    variant: int = 0
    prompt: str = ""
    new_tokens: int = 0


class MonolithicReply(BaseModel):
    """The worker's answer (a JSON line on its stdout)."""

    ok: bool = True
    error: str | None = None
    prompt: str | None = None
    prompt_ids: list[int] = []
    token_times_s: list[float] = []
    token_ids: list[int] = []


class MonolithicInfo(BaseModel):
    """The first line the worker prints, once the model is loaded."""

    parameters: int
    dtype: str
    torch_threads: int
    torch_version: str
    baseline: BaselinePath = "generate"
    # The scheme its weights are held in (the bench's --quantize, auto resolved from the checkpoint).
    quantization: str = "none"


class MonolithicModel:
    """The whole model via transformers' from_pretrained; generate() greedy, timed by a streamer.

    A GGUF file is served by hearth's own one-process path instead (`baseline` "hearth_local"), for generate jobs
    too: transformers' GGUF loader dequantizes every tensor to full precision, so it would neither hold the weights
    the mesh serves (stored codes kept where the scheme allows, hearth/inference/gguf_int4.py) nor fit where the
    quantized model does."""

    def __init__(self, path: Path, device: str | None = None, dtype: str | None = None,
                 quantize: str | None = None) -> None:
        import torch

        self._torch = torch
        self.path = path
        self._device_options = (device, dtype)
        self._quantize = quantize or AUTO_QUANTIZATION
        self._local = None
        if is_gguf_file(path):
            local = self._local_model()
            self.tokenizer = local.head.tokenizer
            self.info = MonolithicInfo(parameters=gguf_parameters(path), dtype=local.info.dtype_name,
                                       torch_threads=torch.get_num_threads(), torch_version=torch.__version__,
                                       baseline="hearth_local", quantization=local.runner.quantization)
            return
        self._load_transformers(device, dtype, self._quantize)

    def _load_transformers(self, device: str | None, dtype: str | None, quantize: str | None) -> None:
        torch = self._torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.path
        if device is None and dtype is None:
            self.device = torch.device("cpu")
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
        else:  # on the device and in the dtype the shards resolve the same options to (inference.devices)
            from hearth.inference.devices import resolve_placement

            self.device, compute_dtype = resolve_placement(device, dtype)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype).to(self.device).eval()
        # Counted before quantizing: quantized Linears hold their weights in buffers, not parameters.
        parameters = sum(p.numel() for p in self.model.parameters())
        dense_dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        from hearth.inference.quantization import (
            QuantizedLinear,
            check_device_supports,
            head_quantization,
            quantize_linears,
        )
        from hearth.inference.stored_precision import resolved_scheme

        # The weights as the mesh holds them: layers in the scheme, the lm_head as load_head keeps it.
        scheme = resolved_scheme(quantize, path, self.device)
        if scheme.quantized:
            check_device_supports(scheme, self.device)
            for layer in self.model.get_decoder().layers:
                quantize_linears(layer, scheme)
            lm_head = self.model.get_output_embeddings()
            if type(lm_head) is torch.nn.Linear and head_quantization(self.device):
                self.model.set_output_embeddings(QuantizedLinear(lm_head, head_quantization(self.device)))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.info = MonolithicInfo(parameters=parameters, dtype=dense_dtype, torch_threads=torch.get_num_threads(),
                                   torch_version=torch.__version__, quantization=scheme.label)

    def handle(self, job: MonolithicJob) -> MonolithicReply:
        if job.kind == "prompt":
            text, ids = build_prompt(self.tokenizer, self.path, job.prompt_tokens, job.variant)
            return MonolithicReply(prompt=text, prompt_ids=ids)
        ids = list(self.tokenizer(job.prompt)["input_ids"])  # exactly as the orchestrator encodes a raw prompt
        local = job.kind == "generate_local" or self.info.baseline == "hearth_local"
        generate = self.generate_local if local else self.generate
        timing = generate(ids, job.new_tokens)
        return MonolithicReply(prompt_ids=ids, token_times_s=timing.token_times_s, token_ids=timing.token_ids)

    def generate(self, prompt_ids: Sequence[int], new_tokens: int) -> GenerationTiming:
        from transformers.generation.streamers import BaseStreamer

        torch = self._torch
        timing = GenerationTiming()
        started = time.perf_counter()
        eos = self.model.generation_config.eos_token_id
        stop_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

        class _Stamps(BaseStreamer):
            prompt_seen = False

            def put(self, value) -> None:
                if not self.prompt_seen:  # generate() first pushes the prompt itself
                    self.prompt_seen = True
                    return
                # The pipeline streams no stop token (a done frame ends its answer): neither is one counted here.
                tokens = [int(token) for token in value.reshape(-1).tolist() if int(token) not in stop_ids]
                if tokens:
                    timing.token_times_s.append(time.perf_counter() - started)
                    timing.token_ids.extend(tokens)

            def end(self) -> None:
                pass

        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=new_tokens, do_sample=False, streamer=_Stamps())
        return timing


    def _local_model(self):
        """hearth's one-process path over the checkpoint (loaded on first use), in the mesh's device, dtype and
        scheme."""
        from hearth.inference.local import load_full
        from hearth.services.common.config_processes import ShardSettings

        if self._local is None:
            device, dtype = self._device_options
            shard = ShardSettings()  # KV caches bounded as a shard's are by default
            self._local = load_full(self.path, device=device, dtype=dtype, quantization=self._quantize,
                                    cache_budget_bytes=shard.kv_cache_budget_bytes, session_ttl_s=shard.eviction_idle_s)
        return self._local

    def generate_local(self, prompt_ids: Sequence[int], new_tokens: int) -> GenerationTiming:
        """Greedy through hearth's one-process path, timed per token from the call."""
        from hearth.inference.sampling import SamplingParams

        local = self._local_model()
        timing = GenerationTiming()
        params = SamplingParams(max_tokens=new_tokens)
        stop_ids = local.head.stop_token_ids(params)
        started = time.perf_counter()
        with self._torch.inference_mode():
            for token_id in local.generate_ids(prompt_ids, params):
                if token_id in stop_ids:  # the last: streamed by no pipeline (generate above says why)
                    break
                timing.token_times_s.append(time.perf_counter() - started)
                timing.token_ids.append(token_id)
        return timing


def gguf_parameters(path: Path) -> int:
    """How many weights the GGUF at `path` holds (every tensor's elements, as its header states them)."""
    from math import prod

    from hearth.inference.gguf_header import read_gguf_header

    return sum(prod(tensor.shape) for tensor in read_gguf_header(path).split.tensors)


def monolithic_worker_main(model_path: str, torch_threads: int | None, device: str | None = None,
                           dtype: str | None = None, quantize: str | None = None) -> None:
    """`python -m hearth.services.devtools.bench PATH [THREADS [DEVICE DTYPE [QUANTIZE]]]`: load the model, answer
    MonolithicJob lines until stdin closes.

    Runs in its own process so that it gets the same OpenMP environment as the shard processes (libgomp
    reads it once, when torch loads) and so that the bench process itself stays free of torch.
    """
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the reply stream
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    try:
        model = MonolithicModel(Path(model_path), device, dtype, quantize)
    except Exception as error:  # a device, scheme or checkpoint it cannot load: the bench says why in one line
        from hearth.inference.errors import first_line

        replies.write(MonolithicReply(ok=False, error=first_line(error)).model_dump_json() + "\n")
        return
    replies.write(model.info.model_dump_json() + "\n")
    for line in sys.stdin:
        try:
            reply = model.handle(MonolithicJob.model_validate_json(line))
        except Exception as error:  # reported to the bench, which stops with the message
            reply = MonolithicReply(ok=False, error=f"{type(error).__name__}: {error}")
        replies.write(reply.model_dump_json() + "\n")


class MonolithicWorker:
    """The bench's handle on the worker process (`python -m hearth.services.devtools.bench`)."""

    def __init__(self, model_path: Path, env: dict[str, str], torch_threads: int | None, log_path: Path, *,
                 device: str | None = None, dtype: str | None = None, cpus: Sequence[int] | None = None,
                 quantize: str | None = None) -> None:
        """`cpus`: the cores the worker may run on (None: any)."""
        from hearth.services.devtools.core_sharing import pinned_command

        self._log = open(log_path, "ab")
        command = [sys.executable, "-m", "hearth.services.devtools.bench", str(model_path), str(torch_threads or 0)]
        if device is not None or dtype is not None or quantize is not None:
            command += [device or "auto", dtype or "auto", *([quantize] if quantize else [])]
        command, pin = pinned_command(command, cpus)
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        env={**os.environ, **env}, text=True, bufsize=1,
                                        cwd=str(SOURCES_ROOT), preexec_fn=pin)
        self.log_path = log_path
        self.model_path = model_path
        self.info: MonolithicInfo | None = None

    def wait_ready(self) -> MonolithicInfo:
        line = self._read_line()
        refusal = MonolithicReply.model_validate_json(line)  # the model's info, or why the worker has no model
        if not refusal.ok:
            raise BenchError(f"the monolithic worker cannot load {self.model_path}: {refusal.error}")
        self.info = MonolithicInfo.model_validate_json(line)
        return self.info

    def _read_line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise BenchError(f"the monolithic worker exited with {self.process.poll()}:\n{tail}")
        return line

    def ask(self, job: MonolithicJob) -> MonolithicReply:
        self.process.stdin.write(job.model_dump_json() + "\n")
        self.process.stdin.flush()
        reply = MonolithicReply.model_validate_json(self._read_line())
        if not reply.ok:
            raise BenchError(f"monolithic worker: {reply.error}")
        return reply

    def prompt(self, prompt_tokens: int, variant: int = 0) -> tuple[str, list[int]]:
        reply = self.ask(MonolithicJob(kind="prompt", prompt_tokens=prompt_tokens, variant=variant))
        return reply.prompt or "", reply.prompt_ids

    def generate(self, prompt: str, new_tokens: int) -> GenerationTiming:
        reply = self.ask(MonolithicJob(kind="generate", prompt=prompt, new_tokens=new_tokens))
        return GenerationTiming(token_times_s=reply.token_times_s, token_ids=reply.token_ids)

    def generate_local(self, prompt: str, new_tokens: int) -> GenerationTiming:
        """The same request through hearth's one-process path (LocalModel)."""
        reply = self.ask(MonolithicJob(kind="generate_local", prompt=prompt, new_tokens=new_tokens))
        return GenerationTiming(token_times_s=reply.token_times_s, token_ids=reply.token_ids)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

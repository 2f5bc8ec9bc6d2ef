"""Head: the orchestrator's part — tokenizer, chat template, embedding, final norm + lm_head, sampling."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from .architectures import ArchitectureAdapter
from .checkpoint import ModelInfo
from .cpu_kernels import onednn_linear, onednn_linear_available
from .detokenizer import TextStream
from .errors import InferenceError
from .layer_call import rope_switch_tokens
from .head_weights import HalfPrecisionHead
from .quantization import QuantizedLinear, held_tensor_bytes
from .sampling import SamplingParams, sample_token

# From this many rows a batched head product on a CPU runs on oneDNN (see Head._product).
head_onednn_min_rows = 5

# lm_heads that compute with their own kernel, bias included (head_weights.py).
_OWN_KERNELS = (QuantizedLinear, HalfPrecisionHead)


class Head:
    """Embedding, final norm and lm_head of one model, with its tokenizer; stateless, so safe to share.

    ``embed`` turns token ids into the hidden states that enter layer 0; ``logits`` turns the hidden
    states that leave the last layer into next-token logits (last position only); ``sample`` picks a
    token; ``text_stream`` turns picked tokens into text deltas and applies stop rules.
    """

    def __init__(
        self,
        *,
        info: ModelInfo,
        config: PretrainedConfig,
        adapter: ArchitectureAdapter,
        embed_tokens: nn.Module,
        final_norm: nn.Module,
        lm_head: nn.Module,
        tokenizer=None,
        eos_token_ids: Iterable[int] = (),
        checkpoint_bytes_read: int = 0,
        device: torch.device | None = None,
    ):
        self.info = info
        # Where embedding and lm_head live; hidden states from elsewhere (the wire's CPU tensors) move here.
        self.device = device or torch.device("cpu")
        self._config = config
        self._adapter = adapter
        self._embed_tokens = embed_tokens
        self._final_norm = final_norm
        self._lm_head = lm_head
        self._tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.checkpoint_bytes_read = checkpoint_bytes_read
        self._head_row_norm: float | None = None

    # ----------------------------------------------------------------- tensors

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Hidden states ``[1, T, hidden_size]`` entering layer 0 for the given token ids."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
        if ids.numel() == 0:
            raise ValueError("token_ids must not be empty")
        if int(ids.min()) < 0 or int(ids.max()) >= self.info.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.info.vocab_size})")
        with torch.inference_mode():
            return self._embed_tokens(ids.to(self.device))

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits ``[vocab]`` from the LAST position of ``[1, T, hidden_size]`` states."""
        if (
            hidden_states.dim() != 3
            or hidden_states.shape[0] != 1
            or hidden_states.shape[2] != self.info.hidden_size
        ):
            raise ValueError(
                f"hidden_states must have shape [1, T, {self.info.hidden_size}], "
                f"got {list(hidden_states.shape)}"
            )
        with torch.inference_mode():
            last = hidden_states[:, -1:, :].to(device=self.device, dtype=self.info.dtype)
            logits = self._lm_head(self._final_norm(last))
            logits = self._adapter.postprocess_logits(logits, self._config)
            # Same cast as generate(): scores are float32 whatever the compute dtype.
            return logits[0, -1].to(dtype=torch.float32)

    def batch_logits(self, hidden_states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 next-token logits ``[B, vocab]`` of the last positions of B sessions' ``[1, T, hidden_size]``
        states as one product, and per row a bound on how far each of its logits may lie from ``logits``' (B >= 1).

        Why a bound: a product of B rows rounds differently from the one-row kernel (about 1e-6 apart in float32), so
        a row whose best two logits lie closer than twice the bound may pick another token than it would alone; the
        bound is the worst case of a length-``hidden_size`` dot product's accumulated rounding, for both products,
        plus the rounding of the logits to the compute dtype (hearth/inference/head_batch.py uses it).
        """
        for states in hidden_states:
            if states.dim() != 3 or states.shape[0] != 1 or states.shape[2] != self.info.hidden_size:
                raise ValueError(f"hidden_states must have shape [1, T, {self.info.hidden_size}], "
                                 f"got {list(states.shape)}")
        with torch.inference_mode():
            last = torch.cat([states[:, -1, :] for states in hidden_states]).to(
                device=self.device, dtype=self.info.dtype)
            normed = self._final_norm(last)
            # The bound below holds for any summation order, so the fastest product serves (BENCHMARKS.md,
            # "Continuous batching on shards", "One batch for hops that share cores").
            products = self._product(normed)
            if getattr(self._lm_head, "bias", None) is not None and not isinstance(self._lm_head, _OWN_KERNELS):
                products = products + self._lm_head.bias
            logits = self._adapter.postprocess_logits(products, self._config).to(dtype=torch.float32)
            accumulated = self.info.hidden_size * torch.finfo(torch.float32).eps * self._largest_head_row_norm()
            rounded = 4 * torch.finfo(self.info.dtype).eps * logits.abs().amax(dim=1)
            bound = 2 * accumulated * normed.float().norm(dim=1) + rounded
            return logits, bound

    def _product(self, normed: torch.Tensor) -> torch.Tensor:
        """``normed @ W^T`` for B rows: on a CPU in float32, W @ h^T for a few rows (BLAS runs the tall product
        faster than h @ W^T), oneDNN's linear from `head_onednn_min_rows` on, where it is the fastest (BENCHMARKS.md,
        "One batch for hops that share cores"). A quantized or float16 lm_head runs its own kernel (bias
        included)."""
        if isinstance(self._lm_head, _OWN_KERNELS):
            return self._lm_head(normed)
        weight = self._lm_head.weight
        if (normed.shape[0] >= head_onednn_min_rows and normed.device.type == "cpu"
                and normed.dtype == torch.float32 and onednn_linear_available()):
            return onednn_linear(normed, weight, None)
        return (weight @ normed.T).T

    def _largest_head_row_norm(self) -> float:
        if isinstance(self._lm_head, _OWN_KERNELS):
            return 0.0  # their kernels compute each row alone: a batch's rows round exactly as one-row products
        if self._head_row_norm is None:
            with torch.inference_mode():
                self._head_row_norm = float(self._lm_head.weight.float().norm(dim=1).amax())
        return self._head_row_norm

    def sample(
        self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> int:
        """The next token id for these logits under ``params`` (greedy when temperature is 0)."""
        return sample_token(logits, params, generator)

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Bytes of the embedding, final norm and lm_head weights (a tied lm_head counts once; they never change, so
        measured once: every batched head step asks, hearth/services/orchestrator/head_batcher.py)."""
        return held_tensor_bytes((self._embed_tokens, self._final_norm, self._lm_head))

    @functools.cached_property
    def rope_switch_tokens(self) -> int | None:
        """The prompt length past which the model's positions rotate on other factors (LongRoPE's original context:
        layer_call), None where its RoPE does not depend on the length."""
        return rope_switch_tokens(self._config)

    # ----------------------------------------------------------------- text

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise InferenceError(f"no tokenizer was found for {self.info.model_id} in {self.info.path}")
        return self._tokenizer

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw prompt, exactly as ``tokenizer(text)["input_ids"]``.

        Special tokens written in it stay special: a raw prompt is a completion prompt that its caller writes whole
        (OpenAI's /v1/completions), so there is no turn of anyone else's in it to forge.
        """
        if not isinstance(text, str):
            raise ValueError("prompt must be a string")
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the chat template (assistant prompt appended; `tools`: the
        functions the model may call, as OpenAI describes them, for the template to render).

        Message text is untrusted: a control token written in it (``<|im_start|>``, an end-of-turn marker, the
        eos) is encoded as plain text, so only the markers the template writes itself are control tokens and a
        message cannot forge a turn. This is transformers' ``sanitize_control_tokens``; a conversation without
        control tokens in its text encodes exactly as without it. A template that builds a non-special marker
        from pieces (``'<|' + role + '|>'``) needs that marker in the tokenizer's ``chat_control_tokens``.
        """
        if not messages or any(
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InferenceError(f"{self.info.model_id} has no chat template; send a raw prompt instead")
        encoded = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(tool) for tool in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            sanitize_control_tokens=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def control_tokens_in(self, texts: Iterable[str]) -> int:
        """How many added tokens (the chat template's control tokens among them) the texts write, at least as many
        as ``encode_chat`` encodes as plain text one by one, which costs far more than the text around it."""
        pattern = self._control_token_pattern
        return 0 if pattern is None else sum(1 for text in texts for _ in pattern.finditer(text))

    @functools.cached_property
    def _control_token_pattern(self) -> re.Pattern | None:
        # Every added token, special or not (whitespace ones aside, which templates write as ordinary text): the
        # control tokens transformers' sanitize_control_tokens marks are among them, so this count bounds that
        # work from above with public tokenizer state only; longest first, as tokens are matched.
        tokens = {token.content for token in self.tokenizer.added_tokens_decoder.values()
                  if token.content and not token.content.isspace()}
        if not tokens:
            return None
        return re.compile("|".join(re.escape(token) for token in sorted(tokens, key=len, reverse=True)))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text decoded alone, special tokens included (a piece of a multi-byte character shows as
        U+FFFD): what log-probabilities name a token by."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The model's end-of-sequence ids plus the request's own stop ids."""
        return self.eos_token_ids | frozenset(params.stop_token_ids)

    def text_stream(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> TextStream:
        """A fresh detokenizer/stop checker for one request (give the prompt ids for correct first spaces)."""
        return TextStream(
            self.tokenizer,
            stop_strings=params.stop,
            stop_token_ids=self.stop_token_ids(params),
            prompt_ids=prompt_ids,
        )

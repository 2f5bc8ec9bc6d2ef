#!/usr/bin/env bash
# Runs issue 14's GPU checks on a lent GPU machine in a few stages that each fit one `device run` call (600 s):
# the CUDA tests, then `hearth bench --device cuda --dtype bf16` on the TinyLlama-1.1B and Llama-3-8B shapes (GPU
# memory per shard in the report) and the CPU figure of the same machine. Everything lands under $OUT.
#
# Here first (wheels the GPU machine's image lacks; it reaches no registry):
#   bash ../shared/gpu/fetch-wheels.sh nkeys cryptography rich starlette uvicorn pytest-timeout hypothesis PyYAML setproctitle py-spy pynacl
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
#   bash scripts/gpu_session.sh llama3-8b-one   # bench, Llama-3-8B shape, bf16, one session (int4's baseline)
#   bash scripts/gpu_session.sh profile      # the int4 8B pipeline under py-spy (fetch-wheels.sh py-spy first):
#                                            # where its processes spend a token (scripts/profile_bench.py)
#   bash scripts/gpu_session.sh prefix       # issue 30: kept prefixes in static caches: a 10-turn conversation through
#                                            # the gateway, cache on and off (scripts/bench_conversation.py)
#   bash scripts/gpu_session.sh tolerance    # issue 28: the honest tolerance of bf16/fp32 CUDA shards
#   bash scripts/gpu_session.sh probe        # launch cost, generate(), LocalModel and one shard's decode step by part
#                                            # (scripts/gpu_probe.py, TinyLlama-1.1B shape)
# HEARTH_GPU_DRY_RUN=1 runs the same stages on this CPU with tiny shapes, to check the script before device time.
# Only 8 files come back from a device call's $OUT: write the stages elsewhere and pack them:
#   G=/tmp/gout; OUT=$G timeout 170 bash scripts/gpu_session.sh llama3-8b; tar czf $OUT/gout.tgz -C /tmp gout
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
site=/tmp/site
if [ -d .whl ] && [ -z "${HEARTH_GPU_DRY_RUN:-}" ]; then
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
if [ -n "${HEARTH_GPU_DRY_RUN:-}" ]; then
  device=cpu; dtype=fp32; big=tiny; mid=tiny
fi

bench() {  # name, then hearth bench arguments
  local name=$1; shift
  echo "== $name: hearth bench $*" | tee -a "$out/stages.txt"
  "$python" -m hearth.services.cli bench "$@" --json --work-dir "$out/work-$name" > "$out/bench-$name.json" \
    2> "$out/bench-$name.log"
  echo "exit $?" | tee -a "$out/stages.txt"
  find "$out/work-$name" -type f ! -name '*.log' -delete; find "$out/work-$name" -type d -empty -delete  # logs only
}

command -v nvidia-smi > /dev/null && nvidia-smi > "$out/nvidia-smi.txt" 2>&1
for stage in "${stages[@]}"; do
echo "== stage $stage starts $(date -u +%T)" | tee -a "$out/stages.txt"
case "$stage" in
  checkpoints)
    "$python" -c "import sys; from hearth.services.devtools.random_models import random_checkpoint as write
for shape in sys.argv[1:]: print(write('random:' + shape))" "$mid" "$big" > "$out/checkpoints.log" 2>&1
    echo "checkpoints exit $?" | tee -a "$out/stages.txt"
    ;;
  tests)
    # Every module with CUDA tests (grep -l mark.cuda): collecting the whole suite would need its every test
    # dependency on the GPU machine.
    "$python" -m pytest -q -m cuda -p no:cacheprovider --timeout 300 $(grep -rl "mark[.]cuda" tests/unit tests/e2e) \
      > "$out/cuda-tests.txt" 2>&1
    echo "cuda tests exit $?" | tee -a "$out/stages.txt"
    tail -5 "$out/cuda-tests.txt"
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
    if [ -z "${HEARTH_GPU_DRY_RUN:-}" ]; then
      "$python" scripts/bench_quantized_linear_cuda.py --repeats 100 > "$out/quant-linear.json" 2> "$out/quant-linear.log"
      echo "quantized linear exit $?" | tee -a "$out/stages.txt"
    fi
    "$python" -m pytest -q -m cuda -p no:cacheprovider --timeout 300 tests/unit/test_quantization_cuda.py \
      tests/e2e/test_cuda_mesh.py > "$out/quant-tests.txt" 2>&1
    echo "quantized cuda tests exit $?" | tee -a "$out/stages.txt"
    tail -5 "$out/quant-tests.txt"
    ;;
  llama3-8b-int4)
    bench "$big-$device-int4" --model "random:$big" --device "$device" --dtype "$dtype" --quantize int4 --repeats 2 \
      --sessions 8 --new-tokens 64 --env HEARTH_SHARD__KV_CACHE_BUDGET_MB=$big_kv_mb
    ;;
  profile)
    # Where the 8B int4 pipeline's processes spend a token (the overhead above its weights' reading, BENCHMARKS.md
    # "Quantized shards on a GPU"): py-spy from .whl samples every shard and the orchestrator; it needs ptrace.
    echo "== profile: scripts/profile_bench.py, $big int4" | tee -a "$out/stages.txt"
    "$python" scripts/profile_bench.py --out "$out/profile" --rate 200 -- --model "random:$big" --device "$device" \
      --dtype "$dtype" --quantize int4 --repeats 1 --sessions 1 --new-tokens 128 > "$out/profile.txt" 2>&1
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
    [ -n "${HEARTH_GPU_DRY_RUN:-}" ] && small=tiny
    bench "batching-$small-graphs" --model "random:$small" --device "$device" --dtype "$dtype" --repeats 2 \
      --sessions 8
    bench "batching-$small-no-graphs" --model "random:$small" --device "$device" --dtype "$dtype" --repeats 2 \
      --sessions 8 --env HEARTH_SHARD__CUDA_GRAPH_MAX_TOKENS=0
    bench "batching-$small-merge-200ms" --model "random:$small" --device "$device" --dtype "$dtype" --repeats 2 \
      --sessions 8 --env HEARTH_SHARD__BATCH_MERGE_WINDOW_MS=200
    ;;
  cpu)
    cpu_model=llama-250m
    [ -n "${HEARTH_GPU_DRY_RUN:-}" ] && cpu_model=tiny
    # 4 torch threads per process, as the CPU figure of ../shared/gpu/README.md was measured.
    bench "$cpu_model-cpu" --model "random:$cpu_model" --device cpu --repeats 3 --sessions 8 --torch-threads 4
    ;;
  together)
    # A quiet machine with more cores than shards: the orchestrator and nats-server run beside the pinned shards.
    together_model=llama-250m
    sizes="2 3 4"
    if [ -n "${HEARTH_GPU_DRY_RUN:-}" ]; then together_model=tiny; sizes=2; fi
    for cores in $sizes; do
      bench "together-$cores" --pin-cores "$cores" --model "random:$together_model" --pin-sessions "$cores" \
        --pin-sessions 8 --repeats 1
    done
    ;;
  prefix)
    conv_model=llama-250m
    [ -n "${HEARTH_GPU_DRY_RUN:-}" ] && conv_model=tiny
    echo "== prefix: scripts/bench_conversation.py conversation --model random:$conv_model" | tee -a "$out/stages.txt"
    "$python" scripts/bench_conversation.py conversation --model "random:$conv_model" --device "$device" \
      --dtype "$dtype" --turns 10 --repeats 2 --modes completions --json "$out/conversation.json" \
      > "$out/conversation.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    tail -30 "$out/conversation.txt"
    ;;
  tolerance)
    echo "== tolerance: scripts/measure_honest_tolerance.py --device $device" | tee -a "$out/stages.txt"
    "$python" scripts/measure_honest_tolerance.py --device "$device" > "$out/tolerance.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    tail -20 "$out/tolerance.txt"
    ;;
  probe)
    echo "== probe: scripts/gpu_probe.py --model random:$mid" | tee -a "$out/stages.txt"
    "$python" scripts/gpu_probe.py --model "random:$mid" --device "$device" --dtype "$dtype" --repeats 2 \
      --json "$out/probe.json" > "$out/probe.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    ;;
  load-memory)
    echo "== load-memory on $device" | tee -a "$out/stages.txt"
    "$python" scripts/bench_load_memory.py --model "random:$mid" --device "$device" --dtypes "$dtype" \
      --json "$out/load-memory.json" > "$out/load-memory.txt" 2>&1
    echo "exit $?" | tee -a "$out/stages.txt"
    ;;
  *)
    echo "unknown stage $stage (checkpoints, tests, prefix, tolerance, quantized, llama3-8b-int4, llama3-8b-one, profile, tinyllama, llama3-8b, llama3-8b-fp32, batching, cpu, together, load-memory or probe)" >&2
    exit 2
    ;;
esac
echo "== stage $stage ends $(date -u +%T)" | tee -a "$out/stages.txt"
done

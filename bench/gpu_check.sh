#!/usr/bin/env bash
# Everything zero_fx checks on one GPU, in one run, and one JSON summary of it:
#
# 1. the cuda tier (pytest -m cuda: tests/test_cuda.py): stages 0-3 on an NCCL group of one
#    with zero_fx's collectives kept (debug.keep_collectives_at_world_one), fp32, bf16 and
#    fp16, experts with their exchanges, int8 quantized collectives, Triton code, the peak
#    against the planner's estimate at a fake world of 8, ...;
# 2. the peer benchmark at a fake world of 8, bf16 (python -m bench.peers): zero_fx-3 by
#    regions and as one program, with its optimizer stepped after the graph instead of in
#    it, zero_fx-3 with recompute="blocks", FSDP2 eager and FSDP2
#    with each block compiled (and on GPT-2 small zero_fx-3 with its bodies as CUDA
#    graphs), on GPT-2 small (seq 1024, batch 8) and a 1B GPT (width 2048,
#    24 blocks, seq 2048, batch 4): tokens/s, MFU, peak, compile time, host enqueue time
#    and a profile of one step.
#
# bench/out/gpu_check.json holds the torch, CUDA and NCCL versions, the git commit, each
# test's outcome and seconds, the figures the tests recorded and the peers' tables. Its
# verdict is "passed" only when every test passed and every peer ran with agreeing losses,
# "failed" otherwise. Made for one H200 in under 8 minutes.
#
#     bench/gpu_check.sh                      # everything
#     GPU_CHECK_PARTS=peers bench/gpu_check.sh    # only the peers (or: tier)
#     bench/gpu_check.sh -k memory            # more pytest options for the tier
#     GPU_CHECK_PARTS=muon bench/gpu_check.sh     # Muon + AdamW beside AdamW (not in the default)
#
# 3. (part "muon", asked for by name) Muon + AdamW against AdamW alone at a fake world of 8,
#    bf16, GPT-2 small: zero_fx-3 (Muon stepped in the graph) and zero_fx-3-update-after, and
#    FSDP2 with every rank orthogonalising, with a profile of one step each (the Newton-Schulz
#    kernels' share); then torch.optim.Muon's loop against the iterations batched by shape on
#    the GPU (python -m bench.experiments.muon_batching --device cuda).
#
# Runs on whatever torch the machine has: it installs zero_fx with --no-deps (and without
# build isolation, which would fetch setuptools), so pip touches neither torch nor anything
# else. Exits 0 only when the verdict is "passed" (or "skipped": no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench/out
mkdir -p "$out"
parts=${GPU_CHECK_PARTS:-tier,peers}
torch_before=$(python -c "import torch; print(torch.__version__)")
python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
torch_after=$(python -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "installing zero_fx changed torch from $torch_before to $torch_after" >&2
    exit 1
fi
commit=$(git rev-parse HEAD 2>/dev/null || echo "${ZERO_FX_COMMIT:-unknown}")
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit with uncommitted changes"
fi
figures="$out/gpu_check_figures.jsonl"
rm -f "$figures" "$out/gpu_check.xml" "$out"/gpu-peers-*.json
start=$(date +%s)
status=0
if [[ $parts == *tier* ]]; then
    # The limit only guards against a hang; at it pytest is interrupted (SIGINT), so it
    # still reports what ran and writes the XML the summary is read from.
    ZERO_FX_GPU_FIGURES="$figures" timeout -s INT -k 30 "${GPU_CHECK_TIER_LIMIT_S:-300}" \
        python -m pytest -m cuda -q -rfEs --junitxml="$out/gpu_check.xml" tests "$@"
    status=$?
fi
peer_results=()
if [[ $parts == *peers* ]] && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    # zero_fx-3-update-after: the optimizer stepped after the graph, beside zero_fx-3's update
    # in it (issue 70): the profiles' kernels and launches differ by the update's
    peers=(zero_fx-3 zero_fx-3-update-after zero_fx-3-whole zero_fx-3-blocks fsdp2 fsdp2-compiled)
    common=(--fake-world 8 --bf16 --steps 7 --warmup 3 --profile
            --peer-limit-s "${GPU_CHECK_PEER_LIMIT_S:-150}")
    # GPT-2 small compiles cold (its compile seconds are the figure); the 1B model's peers
    # share Inductor's caches, to stay within the time (their compile seconds say so)
    # GPT-2 small was host-bound on 2026-11-29: beside it, zero_fx-3 with each compiled body
    # replayed as a CUDA graph, the fix the benchmark is to decide on
    python -m bench.peers --model gpt2-125m --seq 1024 --batch 8 --name gpu-peers-gpt2-125m \
        "${common[@]}" --peers "${peers[@]}" zero_fx-3-cudagraphs
    python -m bench.peers --model gpt-1b --seq 2048 --batch 4 --name gpu-peers-gpt-1b \
        --warm-cache "${common[@]}" --peers "${peers[@]}"
    peer_results=("$out/gpu-peers-gpt2-125m.json" "$out/gpu-peers-gpt-1b.json")
fi
if [[ $parts == *muon* ]] && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    muon_common=(--model gpt2-125m --seq 1024 --batch 8 --fake-world 8 --bf16 --steps 7 --warmup 3
                 --profile --warm-cache --peer-limit-s "${GPU_CHECK_PEER_LIMIT_S:-150}"
                 --peers zero_fx-3 zero_fx-3-update-after fsdp2)
    python -m bench.peers "${muon_common[@]}" --optimizer muon --name gpu-peers-gpt2-125m-muon
    python -m bench.peers "${muon_common[@]}" --name gpu-peers-gpt2-125m-adamw
    python -m bench.experiments.muon_batching --device cuda --width 768 --blocks 12 --ranks 8
    python -m bench.experiments.muon_batching --device cuda --width 2048 --blocks 24 --ranks 8
    # not in the verdict: at a fake world Muon's iterations run on the fake exchanges' values,
    # so its losses are NaN in every peer (measured on the tiny model on a CPU); the tables
    # are bench/out/gpu-peers-gpt2-125m-{muon,adamw}.md
fi
python -m bench.helpers.gpu_check_report --junit "$out/gpu_check.xml" --figures "$figures" \
    --status "$status" --seconds "$(( $(date +%s) - start ))" --commit "$commit" \
    --peers "${peer_results[@]}" --out "$out/gpu_check.json"
python -c "import json, sys; sys.exit(json.load(open('$out/gpu_check.json'))['verdict'] == 'failed')"

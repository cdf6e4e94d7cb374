#!/usr/bin/env bash
# Prepare .kit/ (git-ignored) for a GPU lease, on the CPU machine (research.md "Next leases"):
#   .kit/part-NN, SHA256SUMS, MANIFEST.txt, tools/   ../shared/gpu-kit/build.sh (vLLM 0.26.0 wheels, 48 MiB parts)
#   .kit/extra/                                    orjson (research/gpu/gpu_extra_wheels.sh)
#   .kit/qNN/pNN.{a..f}, .kit/q04/p04.{a,b}         the parts in call-sized pieces: a device call carries
#                                                  64 MiB with the working tree (60.5 MB in 4 KiB blocks after
#                                                  run 17, 48.6 MB of it research-notes/), so with the whole tree
#                                                  each call ships one piece into /tmp/kit/h/. Run 18 shipped
#                                                  whole parts instead (5 calls, not 26): research-notes/ moved
#                                                  out of the working tree for the lease (research/gpu/gpu_lease_tree.sh
#                                                  hold; it keeps the files a phase reads, research/gpu/gpu_inputs.txt)
#   .kit/probewheels/                              what reap_swap's pure modules import beyond torch (pydantic,
#                                                  jsonschema, orjson, ...): a probe on a machine without the kit
# Idempotent: an existing build is reused. Prints the pieces in shipping order.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF /.kit/ .git/info/exclude 2>/dev/null || echo /.kit/ >> .git/info/exclude
[ -f .kit/part-00/vllm-kit.tar.part00 ] || PART_SIZE=48M ../shared/gpu-kit/build.sh .kit
ls .kit/extra/orjson-*.whl > /dev/null 2>&1 || bash research/gpu/gpu_extra_wheels.sh > /dev/null
# the field plan the qwen / families / count phases read (research/gpu/gpu_inputs.txt); run 26's first start
# was refused for want of it
[ -f .kit/strict30-v2-plan.json ] || cp ../shared/fixtures/strict30-v2-plan.json .kit/ 2>/dev/null \
  || echo "no ../shared/fixtures/strict30-v2-plan.json: the qwen, families and count phases will be refused" >&2
for n in 00 01 02 03; do
  [ -f .kit/q$n/p$n.f ] || (rm -rf .kit/q$n && mkdir -p .kit/q$n && cd .kit/q$n && split -n 6 -a 1 ../part-$n/vllm-kit.tar.part$n p$n.)
done
[ -f .kit/q04/p04.b ] || (mkdir -p .kit/q04 && cd .kit/q04 && split -n 2 -a 1 ../part-04/vllm-kit.tar.part04 p04.)
if [ ! -d .kit/probewheels ]; then
  mkdir -p .kit/probewheels
  tmp=$(mktemp -d)
  cat .kit/part-0*/vllm-kit.tar.part0* | tar -x -C "$tmp" --wildcards 'wheels/pydantic-2*' 'wheels/pydantic_core*' \
    'wheels/annotated_types*' 'wheels/typing_inspection*' 'wheels/jsonschema*' 'wheels/referencing*' \
    'wheels/rpds*' 'wheels/dill*'
  mv "$tmp"/wheels/* .kit/probewheels/ && rm -rf "$tmp"
  cp .kit/extra/*.whl .kit/probewheels/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .kit/probewheels attrs tqdm idna typing_extensions
fi
echo "whole parts (run 18): bash research/gpu/gpu_lease_tree.sh hold for the lease (restore after), then carry"
echo "  .kit/tools .kit/MANIFEST.txt .kit/SHA256SUMS .kit/part-00; .kit/part-01; .kit/part-02; .kit/part-03;"
echo "  install call: .kit/part-04 .kit/extra .kit/strict30-v2-plan.json (copy SHA256SUMS into each /tmp/kit/part-NN)"
echo "or, with the whole tree, pieces in this order (call 1 also carries .kit/tools .kit/MANIFEST.txt .kit/SHA256SUMS):"
ls .kit/q0[0-3]/p* .kit/q04/p04.a
echo "install call: carry .kit/q04/p04.b .kit/extra .kit/strict30-v2-plan.json; cat h/pNN.{a..f} and h/p04.a + .kit/q04/p04.b into part-NN/"

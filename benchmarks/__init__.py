"""Benchmarks that are not part of the shipped engine: pdserve against other engines (vLLM's CPU
build, llama.cpp's server, HF transformers) and one-off probes of one part (attention, the C
kernels' instruction sets, the runtime against HF, scoring, serving, SLO control, structured
output, the GPU). Not in the package list, never imported by shipped code; each module is run
from the repository root as `python -m benchmarks.NAME` (scripts/compare, scripts/goodput,
scripts/overload_check and scripts/vs_vllm do that for their four) and may import anything.

Shared pieces: `servers` (starting, measuring and stopping a peer or `pdserve launch`; the peers'
scripts come from ../shared/peers, outside the repository), `machine` (what the figures ran on),
`hf` (HF transformers as a row), `cells` (one run at one load as goodput counts it). The serving
benchmark itself (workloads, back-ends, metrics) is the shipped `pdserve.bench`.
"""

"""`--linear-backend`: which back-end multiplies each of the model's linear layers on the CPU.

Lifecycle: `apply(model, econf, source)` runs once after the fast path is built
(runtime.build.build_model). Modes:
- `rules` (the in-process EngineConfig default): kernels.linear's fixed row-count rules;
- `auto` (the worker commands' default): each linear shape (fused qkv, o, gate_up, down, LM
  head) at each row bucket a step can give it gets the fastest back-end measured here among the
  float32-faithful ones (kernels.backends precision "exact", plus the C kernel in the configured
  `--quant-activations` mode) after each passed its twin check (kernels.select.choose);
- `auto-reduced`: the same, plus the reduced-precision back-ends (bf16, int8 weights or
  activations) whose teacher-forced check passes: the model with every linear layer forced onto
  that back-end must agree with the exact one on the next token at >= MIN_TOP1 of the positions
  of the shipped conversations (pdserve/data/prompts.jsonl, user and assistant turns under the
  chat template) with mean KL <= MAX_KL;
- a back-end name (`c`, `onednn`, `mkl`, `onednn-bf16`, `int8pack`; quantized weights: `c-float`,
  `c-int16`, `c-int8`, `c-int8-vnni`, `dequant-mkl`, `int4pack`): that one at every row count it takes.
The table and the teacher-forced results are cached (kernels.select.cached): a start-up that
finds them measures nothing. The table is logged and kept on `model.fast.linear_table` for the
worker's Hello (`pdserve stats`).
"""
from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path

import torch

from pdserve.kernels import backends, quant, select
from pdserve.kernels.linear import NATIVE_ROWS, ONEDNN_MAX_ROWS
from pdserve_client.errors import InvalidRequestError

log = logging.getLogger("pdserve.runtime")

MIN_TOP1, MAX_KL = 0.99, 0.01  # the bar for a reduced-precision path
PROMPTS = Path(str(resources.files("pdserve") / "data" / "prompts.jsonl"))
GATE_BLOCK = 16


def linears(fast) -> list:
    """Every PackedLinear of a CpuForward: the LM head, then each layer's qkv, o, gate_up, down (a
    SplitLinear's parts, each its own shape and type: a Q4_K_M file's Q4_K q / k beside its Q6_K v)."""
    from pdserve.runtime.cpu_forward import packed_linears

    return [fast.lm_head, *(lin for layer in fast.layers for lin in packed_linears(layer))]


def rules_choice(key: str, rows: int, activations: str) -> str:
    """The back-end kernels.linear's rules run at `rows` rows (the tie-breaker and the budget's fallback)."""
    if not key.endswith(" f32"):
        return f"c-{activations}" if rows <= quant.kernel_rows(activations) else "dequant-mkl"
    if NATIVE_ROWS[0] <= rows <= NATIVE_ROWS[1]:
        return "c"
    return "onednn" if rows <= ONEDNN_MAX_ROWS else "mkl"


def _buckets(lin, lm_head: bool, econf) -> list[int]:
    """Row buckets this layer meets: the LM head takes one row per sequence (max_num_seqs), the
    layers a whole step's tokens (max_num_batched_tokens)."""
    top = min(econf.max_num_seqs if lm_head else econf.max_num_batched_tokens, select.BUCKETS[-1])
    return [b for b in select.BUCKETS if b < top] + [next(b for b in select.BUCKETS if b >= top)]


def _eligible(b: backends.Backend, activations: str, reduced: set[str]) -> bool:
    if b.precision == "exact":
        return True
    return b.name in backends.ACTIVATION_BACKENDS[activations] or b.precision in reduced


def apply(model, econf, source=None) -> select.Table | None:
    """Choose and install the table for model.fast as econf.linear_backend says; None for `rules`."""
    fast = model.fast
    mode = econf.linear_backend
    if fast is None or mode == "rules":
        return None
    lins = linears(fast)
    reps = {}  # shape key -> (one layer of that shape, its buckets)
    for lin in lins:  # (a layer that shares the LM head's shape takes both one's buckets)
        key, buckets = select.shape_key(lin.weight), _buckets(lin, lin is fast.lm_head, econf)
        reps[key] = (lin, sorted(set(buckets) | set(reps[key][1] if key in reps else ())))
    acts = econf.quant_activations
    if mode in backends.BY_NAME:
        table = _fixed(reps, mode, acts)
    else:
        reduced = gate(model, econf, source, reps) if mode == "auto-reduced" else set()
        table = _measured(reps, acts, reduced)
        if fast.fused_step:
            step = {select.shape_key(p.weight) for p in lins if p is not fast.lm_head}  # every layer's, a split qkv's parts too
            for key in pin_one_call_rows(table, step, acts):
                log.warning("linear back-ends: %s keeps c-%s at up to %d rows (the one-call decode step needs it there)", key, acts,
                            ONE_CALL_ROWS)
    for lin in lins:
        lin.use(table.entries[select.shape_key(lin.weight)])
    for lin in {select.shape_key(lin.weight): lin for lin in lins}.values():
        lin.warm()
    fast.linear_table = table
    log.info("linear back-ends (%s, %s in %.1f s):\n%s", mode, table.source, table.seconds, table.text())
    return table


# rows up to which the decoder layers' projections keep the C kernel whatever the timing says: a
# decode step runs all layers in one C call (runtime.cpu_forward) only while every projection is
# the C kernel at its rows, which the per-shape timing cannot see (on a loaded machine it once
# picked int4pack for the 576x576 shape at 1 row, and a lone stream's steps fell back to the
# per-op loop)
ONE_CALL_ROWS = 2


def pin_one_call_rows(table: select.Table, layer_keys: set[str], acts: str) -> list[str]:
    """Set the layer shapes' entries up to ONE_CALL_ROWS rows to c-{acts}; returns the keys changed."""
    c_kernel, changed = f"c-{acts}", []
    for key in sorted(layer_keys):
        rows = table.entries.get(key, [])
        pinned = [(r, c_kernel if r <= ONE_CALL_ROWS else n) for r, n in rows]
        if pinned != rows:
            table.entries[key] = pinned
            changed.append(key)
    return changed


def _fixed(reps: dict, name: str, acts: str) -> select.Table:
    """`name` at every bucket it takes, the rules' choice elsewhere; an error if it runs nowhere."""
    b = backends.BY_NAME[name]
    table = select.Table(source="fixed")
    for key, (lin, buckets) in reps.items():
        ok = b in backends.for_weight(lin.weight) and b.bind(lin.weight) is not None
        if not ok:
            raise InvalidRequestError(f"linear back-end {name} is not supported for {key} weights on this machine")
        table.entries[key] = [(r, name if r <= b.max_rows else rules_choice(key, r, acts)) for r in buckets]
    return table


def _measured(reps: dict, acts: str, reduced: set[str]) -> select.Table:
    candidates = {key: tuple(b for b in backends.for_weight(lin.weight) if _eligible(b, acts, reduced)) for key, (lin, _) in reps.items()}
    parts = {"shapes": {k: b for k, (_, b) in reps.items()}, "candidates": {k: [b.name for b in c] for k, c in candidates.items()},
             "activations": acts}
    key = select.cache_key(parts)
    doc, hit = select.cached("linear", key, lambda: select.choose(
        {k: lin.weight for k, (lin, _) in reps.items()}, {k: b for k, (_, b) in reps.items()}, candidates,
        lambda k, r: rules_choice(k, r, acts)).to_json())
    table = select.Table.from_json(doc)
    table.source = "cached" if hit else "measured"
    for key, why in table.refused.items() if hit else ():
        for name, reason in why.items():
            if key == "(budget)":  # kernels.select.choose's note: the rules' choice from there on (delete the file to measure again)
                log.warning("linear back-end table (cached): %s", reason)
            else:
                log.warning("linear back-end %s refused for %s (cached): %s", name, key, reason)
    return table


def gate(model, econf, source, reps: dict) -> set[str]:
    """The reduced precisions that pass the teacher-forced check (cached per model and machine)."""
    families = {}  # precision -> the back-end that stands for it: the one that takes the most rows (checked at whole prompts)
    for key, (lin, _) in reps.items():
        for b in backends.for_weight(lin.weight):
            if b.precision in ("exact", "int16") or b.name in backends.ACTIVATION_BACKENDS[econf.quant_activations]:
                continue
            held = families.get(b.precision)
            if (held is None or b.max_rows > backends.BY_NAME[held].max_rows) and b.bind(lin.weight) is not None:
                families[b.precision] = b.name
    passed = set()
    for precision, name in sorted(families.items()):
        parts = {"gate": name, "model": str(source), "shapes": sorted(reps), "min_top1": MIN_TOP1, "max_kl": MAX_KL}
        doc, hit = select.cached("gate", select.cache_key(parts), lambda: teacher_forced_check(model, source, name, econf.quant_activations))
        log.info("teacher-forced check of %s (%s%s): top-1 %.2f%% over %d positions, mean KL %.5f: %s", name, precision,
                 ", cached" if hit else "", 100 * doc["top1"], doc["positions"], doc["kl"], "eligible" if doc["passed"] else "refused")
        if doc["passed"]:
            passed.add(precision)
    return passed


def conversations(tokenizer) -> list[list[int]]:
    """The shipped conversations (user and assistant turns) as token ids under the chat template."""
    from pdserve.common.tokenizer import render_chat

    convs = [json.loads(line)["conversations"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [render_chat(tokenizer, [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in c])
            for c in convs]


def teacher_forced_check(model, source, name: str, activations: str, seqs: list[list[int]] | None = None) -> dict:
    """Every position's next-token distribution of each sequence (default: the shipped
    conversations), exact back-ends against `name` forced on every linear layer: top-1 agreement,
    mean KL(exact || name), and whether they meet MIN_TOP1 and MAX_KL."""
    fast = model.fast
    if seqs is None:
        from pdserve.common.tokenizer import load_tokenizer

        seqs = conversations(load_tokenizer(source))
    chunk = backends.BY_NAME[name].max_rows  # a back-end that takes few rows is checked at the rows it runs
    lins = linears(fast)
    saved = [(lin.plan_rows, lin.plan_names, lin.plan_runs) for lin in lins]
    try:
        for lin in lins:
            lin.use([(1 << 62, "mkl" if isinstance(lin.weight, torch.Tensor) else "c-float")])
        ref = [prompt_logits(model, s, chunk) for s in seqs]
        for lin in lins:
            lin.use([(1 << 62, name)])
        got = [prompt_logits(model, s, chunk) for s in seqs]
    finally:
        for lin, (rows, names, runs) in zip(lins, saved):
            lin.plan_rows, lin.plan_names, lin.plan_runs = rows, names, runs
    r, q = torch.cat(ref), torch.cat(got)
    logp = torch.log_softmax(r, -1)
    kl = float(torch.sum(logp.exp() * (logp - torch.log_softmax(q, -1)), -1).mean())
    top1 = float((r.argmax(-1) == q.argmax(-1)).float().mean())
    return {"backend": name, "top1": top1, "kl": kl, "positions": int(r.shape[0]), "passed": top1 >= MIN_TOP1 and kl <= MAX_KL}


def prompt_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """(L - 1, vocab) logits predicting tokens 1..L-1 of one sequence, computed in chunks of at
    most `chunk` query tokens (chunked prefill, each chunk reading the KV of those before)."""
    from pdserve.runtime.kv_cache import allocate_kv_cache
    from pdserve.runtime.model import ForwardBatch

    n = len(ids)
    blocks = -(-n // GATE_BLOCK)
    kv = allocate_kv_cache(model.cfg, blocks, GATE_BLOCK, torch.float32)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    out = []
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids[start:end]), positions=torch.arange(start, end), slot_mapping=torch.arange(start, end),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32), seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=table, max_query_len=end - start, logits_indices=torch.arange(end - start),
        )
        out.append(model(batch, kv))
    return torch.cat(out)

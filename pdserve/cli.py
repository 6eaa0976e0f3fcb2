"""The `pdserve` command line. Each sub-command imports its role lazily, so `pdserve --help`
stays fast and the coordinator's commands never import the model code."""
from __future__ import annotations

import sys
import time

import click

DEFAULT_PROMPT = "Tell me about Paris in two sentences."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """pdserve: a disaggregated prefill/decode LLM inference engine."""


def _sampling_options(f):
    opts = [
        click.option("--max-tokens", default=128, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy"),
        click.option("--top-p", default=1.0, type=float),
        click.option("--top-k", default=-1, type=int),
        click.option("--seed", default=None, type=int),
        click.option("--ignore-eos", is_flag=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@main.command()
@click.argument("prompt", required=False, default=DEFAULT_PROMPT)
@click.option("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--chat/--raw", default=True, show_default=True, help="apply the model's chat template")
@_sampling_options
def generate(prompt, model, dtype, chat, max_tokens, temperature, top_p, top_k, seed, ignore_eos):
    """Generate a completion for PROMPT in this process and stream it to the terminal."""
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.errors import PdserveError
    from runtime.sampling import SamplingParams
    from runtime.tokenizer import render_chat

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        params.validate()
        t0 = time.perf_counter()
        engine = LLMEngine.load(model, EngineConfig(dtype=dtype, kv_cache_bytes=64 * 2**20))
        click.echo(f"[loaded in {time.perf_counter() - t0:.2f}s]", err=True)
        ids = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}]) if chat else engine.encode(prompt)
        engine.add_request(ids, params, request_id="cli")
        t0 = time.perf_counter()
        n = 0
        while engine.has_work():
            for out in engine.step():
                n += out.token_id is not None
                click.echo(out.text, nl=False)
                sys.stdout.flush()
        dt = time.perf_counter() - t0
        click.echo("")
        click.echo(f"[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s]", err=True)
    except PdserveError as e:
        raise click.ClickException(f"{e.code}: {e}") from e

"""The ``pagedspec`` command line.

    pagedspec generate --model DIR --prompt TEXT [--max-tokens N] [--temperature T] ...
    pagedspec bench [runner arguments]          (the benchmark runner, ``python -m pagedspec.bench``)

``generate`` prints each completion, then its token count and tokens/s on stderr.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

COMMANDS = {
    "generate": "complete prompts with a local Hugging Face checkpoint",
    "bench": "run the benchmark runner (kernels, end to end); --help for its options",
}
DEFAULT_MODEL = "pagedspec-demo"


def usage() -> str:
    lines = ["usage: pagedspec COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    lines += ["", "pagedspec COMMAND --help shows a command's options."]
    return "\n".join(lines)


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedspec generate", description=COMMANDS["generate"])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory or shipped model name (default {DEFAULT_MODEL})")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=None, help="stop string; repeatable")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if usable)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--speculative-model", default=None,
                   help="draft checkpoint (or shipped name, e.g. pagedspec-demo-draft), or ngram")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--fixed-k", action="store_true",
                   help="draft num-speculative-tokens every step (no adaptive controller)")
    return p


def generate(argv: Sequence[str]) -> int:
    args = _generate_parser().parse_args(argv)
    from pagedspec import LLM, SamplingParams
    from pagedspec.models import CheckpointError

    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device,
                  kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                  max_model_len=args.max_model_len, max_num_seqs=max(8, len(args.prompt)),
                  speculative_model=args.speculative_model,
                  num_speculative_tokens=args.num_speculative_tokens,
                  speculative_adaptive=not args.fixed_k)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed,
                                n=args.n, stop=args.stop, ignore_eos=args.ignore_eos)
        start = time.perf_counter()
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (CheckpointError, ValueError) as exc:
        print(f"pagedspec generate: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for out in outputs:
        for c in out.outputs:
            print(out.prompt + c.text)
            print(f"[{len(c.token_ids)} tokens, finish: {c.finish_reason}]", file=sys.stderr)
    print(f"pagedspec generate: {num_tokens} tokens in {seconds:.2f} s, "
          f"{num_tokens / seconds:.1f} tokens/s ({llm.device}, {llm.dtype}, "
          f"{llm.checkpoint.path.name})", file=sys.stderr)
    metrics = llm.speculative_metrics()
    if metrics is not None:
        per_pos = ", ".join(f"{a:.2f}" for a in metrics["acceptance_rate_per_position"])
        print(f"speculative: {metrics['num_drafts']} drafts, {metrics['num_draft_tokens']} draft "
              f"tokens, {metrics['num_accepted_tokens']} accepted (acceptance rate "
              f"{metrics['acceptance_rate']:.1%}, per position {per_pos}; mean acceptance length "
              f"{metrics['mean_acceptance_length']:.2f}); per step: draft "
              f"{metrics['draft_seconds_per_step'] * 1e3:.2f} ms, target "
              f"{metrics['target_seconds_per_step'] * 1e3:.2f} ms", file=sys.stderr)
    return 0


def bench(argv: Sequence[str]) -> int:
    from pagedspec.bench import runner

    return runner.main(list(argv)) or 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "generate":
        return generate(rest)
    if command == "bench":
        return bench(rest)
    print(f"pagedspec: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

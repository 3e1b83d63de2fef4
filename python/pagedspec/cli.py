"""The ``pagedspec`` command line.

    pagedspec generate --model M --prompt TEXT [--max-tokens N] [--temperature T] ...
    pagedspec serve --model M [--speculative-model D] [--host 127.0.0.1] [--port 8000] ...
    pagedspec convert IN.gguf OUT_DIR
    pagedspec bench [runner arguments]          (the benchmark runner, ``python -m pagedspec.bench``)
    pagedspec bench serve [load arguments]      (the serving load benchmark)

``generate`` prints each completion, then its token count and tokens/s on stderr. The engine's
flags of ``generate`` and ``serve`` come from :class:`pagedspec.EngineConfig`'s fields.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from pagedspec.engine.config import EngineConfig

COMMANDS = {
    "generate": "complete prompts with a local checkpoint (directory, .gguf or short name)",
    "serve": "an OpenAI-compatible HTTP server (needs the serve extra: pip install "
             "'pagedspec[serve]')",
    "convert": "write a .gguf checkpoint as a Hugging Face directory",
    "bench": "run the benchmark runner (kernels, end to end; `bench serve`: the serving load "
             "benchmark); --help for its options",
}


def usage() -> str:
    lines = ["usage: pagedspec COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    lines += ["", "pagedspec COMMAND --help shows a command's options."]
    return "\n".join(lines)


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedspec generate", description=COMMANDS["generate"])
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat for a batch")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64)
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--sampling-seed", type=int, default=None,
                          help="the requests' seed (--seed seeds the engine)")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--stop", action="append", default=None,
                          help="stop string; repeatable")
    sampling.add_argument("--ignore-eos", action="store_true")
    from pagedspec.models.loader import default_model

    EngineConfig.add_cli_args(p, model_default=default_model())
    return p


def generate(argv: Sequence[str]) -> int:
    args = _generate_parser().parse_args(argv)
    from pagedspec import LLM, SamplingParams
    from pagedspec.models import CheckpointError

    try:
        config = EngineConfig.from_cli_args(args)
        kwargs = {k: v for k, v in vars(config).items() if k != "model"}
        llm = LLM(config.model, **kwargs)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, max_tokens=args.max_tokens,
                                seed=args.sampling_seed, n=args.n, stop=args.stop,
                                ignore_eos=args.ignore_eos)
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
    if argv and argv[0] == "serve":
        from pagedspec.bench import serve

        return serve.main(list(argv[1:])) or 0
    from pagedspec.bench import runner

    return runner.main(list(argv)) or 0


def serve(argv: Sequence[str]) -> int:
    try:
        from pagedspec.serve.app import main as serve_main
    except ImportError as exc:
        print(f"pagedspec serve: {exc}; install the server's dependencies with "
              "pip install 'pagedspec[serve]'", file=sys.stderr)
        return 2
    return serve_main(list(argv)) or 0


def convert(argv: Sequence[str]) -> int:
    from pagedspec.models.gguf import main_convert

    return main_convert(list(argv)) or 0


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
    if command == "serve":
        return serve(rest)
    if command == "convert":
        return convert(rest)
    print(f"pagedspec: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

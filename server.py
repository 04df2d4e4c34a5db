"""luxjax OpenAI-compatible server. Flags follow llama-server's names:

    python server.py [MODEL] [--mmproj MMPROJ] [--host 127.0.0.1] [--port 8080] [-c MAX_CTX]
                     [--max-concurrency 4] [--max-queue 64] [--api-key KEY] [--dtype bfloat16|float32]
                     [--config configs/default.toml]

Without MODEL the small model shipped in the package is served. Every flag can be set in the TOML file;
flags given on the command line win.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="luxjax OpenAI-compatible server", argument_default=None)
    p.add_argument("model", nargs="?", help="decoder GGUF or Hugging Face directory (default: the packaged model)")
    p.add_argument("-m", "--model", dest="model_flag", help="same as the positional MODEL")
    p.add_argument("--mmproj", help="vision projector GGUF (enables image input for a GGUF decoder)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("-c", "--max-ctx", "--ctx-size", dest="max_ctx", type=int, help="tokens per sequence")
    p.add_argument("-np", "--max-concurrency", "--parallel", dest="max_concurrency", type=int,
                   help="cache slots: sequences decoded together (a step runs only the slots in use)")
    p.add_argument("--max-queue", type=int)
    p.add_argument("--api-key")
    p.add_argument("--dtype", choices=["bfloat16", "float32"])
    p.add_argument("--cache-dir")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step while other streams decode")
    p.add_argument("--solo-prefill-chunk", type=int, help="prompt tokens per prefill step while none decodes")
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("-a", "--alias", dest="model_alias", help="model id reported by /v1/models")
    p.add_argument("--cors-origins", help='browser origins allowed to call the API, comma-separated, or "*"')
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--config", help="TOML file of settings (keys are the flag names)")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace):
    from luxjax.http.settings import build_settings, read_toml

    cli = {k: v for k, v in vars(args).items() if k not in ("config", "model_flag")}
    cli["model"] = args.model or args.model_flag
    return build_settings(read_toml(args.config) if args.config else {}, cli)


def load_model(settings):
    import luxjax.api

    kwargs = {"max_context": settings.max_ctx}
    if settings.cache_dir is not None:
        luxjax.api.cache_compiled_programs(Path(settings.cache_dir) / "xla")
        kwargs["cache_dir"] = settings.cache_dir
    return luxjax.api.load(settings.model, settings.mmproj, settings.dtype, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from luxjax.engine.scheduler import Engine
    from luxjax.http.app import create_app
    from luxjax.http.settings import engine_options

    model = load_model(settings)
    backend = model.backend
    engine = Engine(backend, **engine_options(settings)).start()
    print(f"model: {settings.model or '(packaged default)'} as {settings.model_id!r}; vocab {backend.vocab_size}, "
          f"dtype {backend.dtype}, images {'yes' if backend.supports_images else 'no (start with --mmproj)'}; "
          f"context {engine.max_ctx} x {engine.max_concurrency} slots, queue {engine.max_queue}", flush=True)
    print(f"listening on http://{settings.host}:{settings.port}  (OpenAI base URL: "
          f"http://{settings.host}:{settings.port}/v1)", flush=True)
    try:
        uvicorn.run(create_app(engine, settings), host=settings.host, port=settings.port,
                    log_level=settings.log_level, access_log=False)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

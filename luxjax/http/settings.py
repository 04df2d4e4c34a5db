"""Server settings: one frozen dataclass, filled from a TOML file and then from command-line flags."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1024 * 1024


@dataclass(frozen=True)
class Settings:
    model: str | None = None  # decoder GGUF or Hugging Face directory; None: the model shipped in the package
    mmproj: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    max_ctx: int = 8192  # tokens per sequence (prompt incl. images + generated); also the cache length per slot
    max_concurrency: int = 4  # sequences decoded together (cache slots)
    max_queue: int = 64  # requests waiting for a slot before 503
    api_key: str | None = None
    dtype: str = "bfloat16"
    cache_dir: str | None = None
    prefill_chunk: int = 512  # prompt tokens per prefill step, so long prompts do not stall running streams
    solo_prefill_chunk: int = 2048  # ... while no stream is decoding: most prompts in one step (first token sooner)
    max_body_bytes: int = 48 * MiB
    model_alias: str | None = None  # the id /v1/models reports; default: the model file or folder name
    cors_origins: str | None = None  # browser origins allowed to call the API, comma-separated, or "*"; None: none
    log_level: str = "info"

    @property
    def model_id(self) -> str:
        if self.model_alias:
            return self.model_alias
        return Path(self.model).name if self.model else "luxjax-default"


def cors_origins(settings: Settings) -> list[str]:
    return [origin.strip() for origin in (settings.cors_origins or "").split(",") if origin.strip()]


def engine_options(settings: Settings) -> dict[str, int]:
    """The scheduler's keyword arguments (luxjax.engine.scheduler.Engine) these settings give."""
    return {name: getattr(settings, name) for name in
            ("max_concurrency", "max_queue", "max_ctx", "prefill_chunk", "solo_prefill_chunk")}


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Settings)]


def read_toml(path: str | Path) -> dict[str, Any]:
    """The settings a TOML file gives (keys are flag names; '-' and '_' both accepted). Unknown keys are refused."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}; known: {field_names()}")
    return values


def build_settings(file_values: dict[str, Any], cli_values: dict[str, Any]) -> Settings:
    """Defaults, overridden by the file, overridden by flags given on the command line (None = not given)."""
    merged = {**file_values, **{k: v for k, v in cli_values.items() if v is not None}}
    settings = Settings(**merged)
    if settings.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, not {settings.dtype!r}")
    for name in ("max_ctx", "max_concurrency", "prefill_chunk", "solo_prefill_chunk", "max_body_bytes"):
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be positive")
    if settings.max_queue < 0:
        raise ValueError("max_queue must be >= 0")
    return settings

"""The compose deployment's files as `docker compose` reads them (no Docker needed): YAML with
``${VAR:-default}`` interpolated from infra/.env."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

INFRA = Path(__file__).resolve().parents[1] / "infra"
_VAR = re.compile(r"\$\{([A-Za-z0-9_]+)(?:(:?[-+])([^}]*))?\}")


def dotenv() -> dict[str, str]:
    values = {}
    for line in (INFRA / ".env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def _substitute(value: str | None, operator: str | None, word: str) -> str:
    if operator is not None and operator.endswith("+"):
        return word if value else ""
    return value or word


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR:-default}`` and ``${VAR:+replacement}`` interpolation, as `docker compose`
    does it with infra/.env."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: _substitute(env.get(m.group(1)), m.group(2), m.group(3) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_compose(name: str = "docker-compose.yml") -> Any:
    """A compose file of infra/, interpolated."""
    return interpolate(yaml.safe_load((INFRA / name).read_text()), dotenv())


def published(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host address, container port) of each port a compose service publishes (no address given:
    every interface of the host)."""
    out = []
    for port in service.get("ports", []):
        parts = str(port).split(":")
        out.append((parts[0] if len(parts) == 3 else "0.0.0.0", parts[-1]))
    return out

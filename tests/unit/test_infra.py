"""The compose deployment, checked without a Docker engine: the file against the Compose
specification's JSON schema, every command against the CLI, every NATS user against the accounts,
and the NATS configs with ``nats-server -t``."""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from apps import registry
from apps.cli import build_parser
from apps.deployment import COMPOSE_NODES, COMPOSE_SOURCES, accounts, nats_users
from gpuherd.natsd import find_binary
from gpuherd.runtime import shell
from gpuherd.security import password_env
from tests.compose_file import INFRA, load_compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def _gpuherd_services(compose: dict[str, Any]) -> dict[str, Any]:
    return {name: s for name, s in compose["services"].items() if "gpuherd" in str(s.get("image", ""))}


def test_compose_file_follows_the_compose_specification() -> None:
    schema_file = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    document = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def test_every_command_exists_in_the_cli(compose: dict[str, Any]) -> None:
    services = _gpuherd_services(compose)
    assert {"init", "scheduler", "elastic", "memory", "analytics", "sim-1", "gpu-1"} <= set(services)
    for name, service in services.items():
        argv = service["command"]
        assert build_parser().parse_args(argv).func, name  # exits (SystemExit) on an unknown command or option
        if argv[0] == "serve":
            shell.build_parser(registry.spec(argv[1])).parse_args(argv[2:])


def test_background_deciders_yield_the_cpu_in_compose_as_they_do_on_one_host(compose: dict[str, Any]) -> None:
    """A service whose spec lowers its priority (``nice``) gets a lower CPU weight in compose, where a
    process's nice does not reach past its container; the others keep the default."""
    for name, service in _gpuherd_services(compose).items():
        argv = service["command"]
        if argv[0] != "serve":
            continue
        spec = registry.spec(argv[1])
        assert (service.get("cpu_shares", 1024) < 1024) == (spec.nice > 0), name


def test_three_nats_servers_with_health_checks_and_volumes(compose: dict[str, Any]) -> None:
    servers = {n: s for n, s in compose["services"].items() if n.startswith("nats-")}
    assert sorted(servers) == ["nats-1", "nats-2", "nats-3"]
    for name, server in servers.items():
        assert "healthz?js-enabled-only=true" in " ".join(server["healthcheck"]["test"]), name
        assert any(v.endswith(":/data") and v.split(":")[0] in compose["volumes"] for v in server["volumes"]), name
        assert server["environment"]["NATS_SERVER_NAME"] == name
    routes = (INFRA / "nats" / "server.conf").read_text()
    assert all(f"nats-route://{n}:6222" in routes for n in servers)


def test_every_process_runs_as_its_own_user_with_its_secret(compose: dict[str, Any]) -> None:
    known = {u.name for u in nats_users(COMPOSE_NODES, COMPOSE_SOURCES)}
    made = shlex.split(re.search(r'USERS="([^"]+)"', (INFRA / "make-secrets.sh").read_text()).group(1))
    assert known | {"sys"} == set(made), "make-secrets.sh and the accounts must name the same users"
    seen_users = set()
    for name, service in _gpuherd_services(compose).items():
        env = service["environment"]
        user = env["NATS_USER"]
        assert user in known, (name, user)
        assert user not in seen_users or name == "init", f"{user} used twice"
        seen_users.add(user)
        assert env["NATS_PASSWORD_FILE"] == f"/run/secrets/{user}" and service["secrets"] == [user], name
        assert compose["secrets"][user]["file"] == f"./secrets/{user}"
        assert "NATS_PASSWORD" not in env, "no password in the compose file"
        if name != "init":
            assert env["GPUHERD_STREAMS"] == "require", name
            port = env["GPUHERD_METRICS_PORT"]
            assert f"localhost:{port}/healthz" in " ".join(service["healthcheck"]["test"]), name
        if service["command"][:2] == ["serve", "agent"]:
            node = service["command"][service["command"].index("--node") + 1]
            assert user == f"agent-{node}", name
    assert compose["services"]["init"]["environment"]["GPUHERD_STREAMS"] == "create"


def test_gpu_agent_gets_the_gpus_and_the_dockerfile_runs_as_non_root(compose: dict[str, Any]) -> None:
    gpu = compose["services"]["gpu-1"]
    assert gpu["gpus"] == "all" and "--executor" in gpu["command"] and "nvml" in gpu["command"]
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert re.search(r"^USER herd$", dockerfile, re.M) and 'ENTRYPOINT ["gpuherd"]' in dockerfile
    assert "PASSWORD" not in dockerfile.replace("NATS_PASSWORD_FILE", "").replace("NATS_PASSWORD ", "")


@pytest.mark.parametrize("config", ["server.conf", "server-tls.conf"])
def test_nats_configs_parse(config: str, tmp_path: Path) -> None:
    env = dict(os.environ, NATS_SERVER_NAME="nats-1")
    env.update({password_env(u.name): "x" for u in nats_users()} | {"GPUHERD_PW_SYS": "x"})
    text = (INFRA / "nats" / config).read_text()
    if "certs" in text:  # the TLS files must exist for the test to pass: make a dev CA for it
        certs = tmp_path / "certs"
        subprocess.run([str(INFRA / "nats" / "make-dev-ca.sh"), str(certs)], check=True, capture_output=True)
        text = text.replace("/etc/nats/certs", str(certs))
    conf = tmp_path / config
    conf.write_text(text)
    (tmp_path / "accounts.conf").write_text((INFRA / "nats" / "accounts.conf").read_text())  # includes are relative
    result = subprocess.run([find_binary(), "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_accounts_match_the_generator() -> None:
    assert (INFRA / "nats" / "accounts.conf").read_text() == accounts(COMPOSE_NODES, COMPOSE_SOURCES), (
        "infra/nats/accounts.conf is stale: run `gpuherd security nats-accounts > infra/nats/accounts.conf`"
    )

"""docker-compose.yml, the Dockerfile and .dockerignore, checked against the code without Docker.

No Docker engine runs on this machine (nor in CI), so the images are not built and the
suite is not started by these tests: they read the files and hold them to what the code
says. Names of variables come from the settings classes (and OpenTelemetry's own list);
processes, modules, ports and links from ``topology.suite()``, which ``sokutatsu up`` runs
(tested for real in tests/cli); paths from the repository's tree. What only a Docker
engine can show (the images build, the containers become healthy) is not checked here.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import opentelemetry.sdk.environment_variables as otel_variables
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from sokutatsu.cli.settings import ALL_SETTINGS
from sokutatsu.cli.topology import ServiceProcess, suite
from sokutatsu.core.cluster import FILE_VAR, ClusterSettings
from sokutatsu.core.runtime_settings import RuntimeSettings
from sokutatsu.core.settings import Settings, describe, load

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HEALTHCHECK = ["CMD", "python", "-m", "sokutatsu.core.healthcheck"]

# Variables compose sets that `sokutatsu up` does not (yet), per process. Empty since the
# launcher wires the sequencer group (issue #21); once topology.py sets one listed here, the
# test asks for it to be removed.
BEYOND_LAUNCHER: dict[str, set[str]] = {}

_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
# host:port inside a value: "broker-a:7201", "b=seq-b:7102", "...@postgres-1:5432/db", "http://jaeger:4317".
_ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z][\w.-]*):(\d+)\b")


# ------------------------------------------------------------------ reading --


def _interpolate(value: Any) -> Any:
    """Compose's interpolation with every variable at its default (``${X:-d}`` → d, ``$$`` → ``$``)."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(2) or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@cache
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = _interpolate(yaml.safe_load(COMPOSE.read_text()))
    return loaded


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def environment(name: str) -> dict[str, str]:
    env = services()[name].get("environment", {})
    assert isinstance(env, dict), f"{name}: write environment as a mapping (anchors merge into mappings)"
    return {str(k): str(v) for k, v in env.items()}


def ours(name: str) -> bool:
    """Whether the service runs an image built from this repository's Dockerfile."""
    return "build" in services()[name]


def jobs() -> set[str]:
    """One-shot services `docker compose up` runs before the others (making the cluster secret):
    those another service waits for with ``service_completed_successfully``."""
    return {
        other
        for spec in services().values()
        for other, condition in (spec.get("depends_on") or {}).items()
        if condition == {"condition": "service_completed_successfully"}
    }


def long_running() -> list[str]:
    """Services `docker compose up` starts and keeps (jobs run once, or live under a profile)."""
    return [name for name, spec in services().items() if not spec.get("profiles") and name not in jobs()]


def listen(name: str) -> str:
    values = [v for k, v in environment(name).items() if k.startswith("SOKUTATSU_") and k.endswith("_LISTEN")]
    assert len(values) == 1, f"{name}: expected one SOKUTATSU_*_LISTEN, found {values}"
    return values[0]


def listening_ports(name: str) -> set[int]:
    """The ports a service answers on inside the network: its LISTEN, ``expose`` and published container ports."""
    spec = services()[name]
    ports = {int(str(p).split("/")[0]) for p in spec.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in spec.get("ports", [])}
    if ours(name) and not spec.get("profiles"):
        ports.add(int(listen(name).rpartition(":")[2]))
    return ports


def mounts(name: str) -> dict[str, str]:
    """Mount target -> named volume (bind mounts are not used)."""
    found = {}
    for entry in services()[name].get("volumes", []):
        source, _, target = str(entry).partition(":")
        found[target.split(":")[0]] = source
    return found


def depends_on(name: str) -> dict[str, dict[str, str]]:
    deps = services()[name].get("depends_on", {})
    assert isinstance(deps, dict), f"{name}: write depends_on as a mapping with a condition for each service"
    return deps


def topology() -> dict[str, ServiceProcess]:
    return {spec.name: spec for spec in suite()}


def settings_class(prefix: str) -> type[Settings]:
    classes = {cls.env_prefix: cls for _, cls in ALL_SETTINGS if cls.env_prefix != "SOKUTATSU_"}
    return classes[prefix]


def otel_names() -> set[str]:
    return {v for k, v in vars(otel_variables).items() if k.startswith("OTEL_") and isinstance(v, str)}


# ------------------------------------------------------------ the compose file --


def test_compose_parses_and_names_its_volumes() -> None:
    assert compose()["name"] == "sokutatsu"
    declared = set(compose().get("volumes") or {})
    used = set()
    for name, spec in services().items():
        assert "image" in spec or "build" in spec, f"{name}: no image and nothing to build"
        used |= set(mounts(name).values())
    assert used, "no service mounts a volume"
    assert used <= declared, f"volumes used but not declared at the top level: {sorted(used - declared)}"
    assert declared <= used, f"volumes declared but never mounted: {sorted(declared - used)}"


@pytest.mark.parametrize("name", [n for n in services() if services()[n].get("environment")])
def test_environment_names_are_known_settings(name: str) -> None:
    """SOKUTATSU_* names are the service's own or every process's; values parse; OTEL_* names are the SDK's."""
    env = environment(name)
    spec = topology().get(name)
    runtime_names = {knob.env for knob in describe(RuntimeSettings)} | {knob.env for knob in describe(ClusterSettings)}
    for key in env:
        if key.startswith("OTEL_"):
            assert key in otel_names(), f"{name}: {key} is not an OpenTelemetry SDK variable"
        elif key.startswith("SOKUTATSU_"):
            own = spec is not None and key.startswith(spec.prefix)
            assert own or key in runtime_names, f"{name}: {key} is read by no settings class of this process"
    # The services' own loading: refuses unknown names under the prefixes and malformed values.
    load(RuntimeSettings, env)
    load(ClusterSettings, env)
    if spec is not None:
        load(settings_class(spec.prefix), env)


def test_addresses_name_a_service_and_a_port_it_listens_on() -> None:
    checked = 0
    for name in services():
        for key, value in environment(name).items():
            for host, port in _ADDRESS.findall(value):
                assert host in services(), f"{name}: {key}={value}: {host} is not a service of docker-compose.yml"
                assert int(port) in listening_ports(host), (
                    f"{name}: {key}={value}: {host} listens on {sorted(listening_ports(host))}, not {port}"
                )
                checked += 1
    assert checked >= len(topology()), "too few addresses found: is the pattern still right?"


@pytest.mark.parametrize("name", [n for n in long_running() if ours(n)])
def test_services_listen_on_their_own_name(name: str) -> None:
    """The address a service reports (the standby broker to the active) must resolve for the others."""
    host, _, port = listen(name).rpartition(":")
    assert host == name
    published = {str(p).rsplit(":", 1)[-1] for p in services()[name].get("ports", [])}
    assert published <= {port}, f"{name}: publishes container ports {published}, listens on {port}"


@pytest.mark.parametrize("name", long_running())
def test_long_running_services_have_a_healthcheck(name: str) -> None:
    check = services()[name].get("healthcheck", {})
    assert check.get("test"), f"{name}: no healthcheck"
    if ours(name):
        assert check["test"] == [*HEALTHCHECK, listen(name)], f"{name}: health-check the address it listens on"


def _seconds(duration: str) -> float:
    """A compose duration such as "10s", "1m30s" or "500ms", in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts, f"not a duration: {duration!r}"
    assert "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("name", long_running())
def test_long_running_services_say_how_long_a_stop_may_take(name: str) -> None:
    """Written out: podman's Docker API gives a container created without it 0 s (SIGKILL at once)."""
    grace = services()[name].get("stop_grace_period")
    assert grace, f"{name}: set stop_grace_period"
    if ours(name):
        # The service's own grace, then the overrun after which it logs what it still waits for.
        needed = RuntimeSettings().grace_seconds + 2.0
        assert _seconds(str(grace)) >= needed, f"{name}: stop_grace_period {grace} < {needed} s"


@pytest.mark.parametrize("name", long_running())
def test_health_checks_are_not_too_frequent(name: str) -> None:
    """A Sokutatsu check costs ~0.3 s of CPU; compose refuses start_interval below Docker Engine 25."""
    check = services()[name].get("healthcheck", {})
    assert "start_interval" not in check, f"{name}: start_interval needs Docker Engine 25 (and not podman)"
    if ours(name):
        assert _seconds(str(check.get("interval", "30s"))) >= 10, f"{name}: check at most every 10 s"


@pytest.mark.parametrize("name", [n for n in services() if services()[n].get("depends_on")])
def test_depends_on_waits_for_health(name: str) -> None:
    for other, condition in depends_on(name).items():
        assert other in services(), f"{name} depends on {other}, which is not a service"
        assert not services()[other].get("profiles"), f"{name} depends on {other}, which only runs in a profile"
        if other in jobs():
            wanted = "service_completed_successfully"
        else:
            wanted = "service_healthy" if services()[other].get("healthcheck") else "service_started"
        assert condition == {"condition": wanted}, f"{name} -> {other}: expected condition {wanted}"


def test_every_service_reads_the_cluster_secret_from_the_job_that_makes_it() -> None:
    """Issue #20: control RPCs need the cluster secret; compose makes one on its first `up`."""
    (job,) = jobs()
    assert services()[job]["command"] == ["sokutatsu", "cluster-secret", "--file", "/cluster/secret"]
    volume = mounts(job)["/cluster"]
    for name in topology():
        assert environment(name)[FILE_VAR] == "/cluster/secret", name
        assert mounts(name)["/cluster"] == volume, name
        assert depends_on(name)[job] == {"condition": "service_completed_successfully"}, name


def test_depends_on_has_no_cycle() -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for other in depends_on(name):
                visit(other, (*path, name))
            done.add(name)

    for name in services():
        visit(name, ())


def test_postgres_allows_prepared_transactions() -> None:
    """The transfer daemon's 2PC mode prepares transactions on both nodes."""
    hosts = {
        str(conninfo_to_dict(value)["host"])
        for name in services()
        for key, value in environment(name).items()
        if key.endswith("_DSN")
    }
    assert hosts
    for host in hosts:
        setting = re.search(r"max_prepared_transactions=(\d+)", " ".join(map(str, services()[host]["command"])))
        assert setting, f"{host}: set max_prepared_transactions"
        assert int(setting.group(1)) > 0


# ------------------------------------------------------------- the topology --


def test_compose_runs_the_processes_of_the_topology() -> None:
    runs_module = {n for n in long_running() if ours(n)}
    assert runs_module == set(topology()), "compose's Sokutatsu services and topology.suite() differ"


@pytest.mark.parametrize("spec", suite(), ids=lambda s: s.name)
def test_each_process_matches_the_topology(spec: ServiceProcess) -> None:
    name, prefix = spec.name, spec.prefix
    service = services()[name]
    env = environment(name)
    assert service["command"] == ["python", "-m", spec.module]

    addresses = {s.name: f"{s.name}:{s.fixed_port}" for s in suite()}
    expected = {**spec.env, prefix + "INSTANCE": name, prefix + "LISTEN": addresses[name]}
    expected.update(spec.linked_env(addresses))
    own = {k: v for k, v in env.items() if k.startswith(prefix)}
    for key, value in expected.items():
        assert own.get(key) == value, f"{name}: {key}={own.get(key)!r}, topology.py gives {value!r}"

    state, dsn = prefix + "STATE_DIR", prefix + "DSN"
    if spec.keeps_state:
        volume = mounts(name).get(env.get(state, "(unset)"))
        assert volume, f"{name}: {state} must be a volume's mount point (the process keeps files)"
        others = [n for n in services() if n != name and volume in mounts(n).values()]
        assert not others, f"{name}: its state volume {volume} is also mounted by {others}"
    else:
        assert state not in env
    if spec.database:
        db = conninfo_to_dict(env[dsn])
        assert db["dbname"] == spec.database
        assert environment(str(db["host"])).get("POSTGRES_DB") == spec.database
        assert str(db["host"]) in depends_on(name) or any(
            str(db["host"]) in depends_on(other) for other in depends_on(name)
        ), f"{name}: start after {db['host']}"
    else:
        assert dsn not in env

    beyond = BEYOND_LAUNCHER.get(name, set())
    stale = beyond & (set(spec.env) | set(spec.links))
    assert not stale, f"topology.py now sets {sorted(stale)} for {name}: drop them from BEYOND_LAUNCHER"
    extra = set(own) - set(expected) - {state, dsn} - beyond
    assert not extra, f"{name}: compose sets {sorted(extra)}, which topology.py does not"
    # The launcher starts a linked process first; compose must too (not for peer_links: the
    # launcher knows a pinned process's address before it starts, compose by its service name).
    for template in spec.links.values():
        for other in re.findall(r"\{([\w-]+)\}", template):
            assert other in depends_on(name), f"{name} links {other}: depend on it"


def test_every_process_traces_to_jaeger_and_the_shared_volume() -> None:
    analytics = services()["analytics"]
    command = analytics["command"]
    assert command[:2] == ["sokutatsu", "analyze"]
    traces_in = command[command.index("--traces") + 1]
    reports_in = command[command.index("--out") + 1]
    traces_volume = mounts("analytics")[traces_in]
    assert mounts("analytics").get(reports_in), "the report folder is not on a volume: it would be lost"
    assert analytics["profiles"] == ["analytics"]
    assert "jaeger" in services()
    for name in topology():
        env = environment(name)
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://jaeger:4317"
        assert mounts(name).get(env.get("SOKUTATSU_TRACE_DIR", "(unset)")) == traces_volume, (
            f"{name}: SOKUTATSU_TRACE_DIR must be where the traces volume is mounted"
        )


# ------------------------------------------------------- Dockerfile, .dockerignore --


def dockerfile_instructions() -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, words) per instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        words = line.split()
        if words:
            out.append((words[0].upper(), words[1:]))
    return out


def stages() -> list[str]:
    return [words[2] for op, words in dockerfile_instructions() if op == "FROM" and len(words) == 3]


def copies() -> list[list[str]]:
    """COPY instructions' sources that come from the build context."""
    found = []
    for op, words in dockerfile_instructions():
        if op == "COPY" and not any(w.startswith("--from=") for w in words):
            found.append([w for w in words if not w.startswith("--")][:-1])
    return found


def ignored(path: str) -> bool:
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        bare = pattern.removeprefix("**/")
        parts = Path(path).parts
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, bare) for part in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) for i in range(len(parts))):
            return True
    return False


def test_compose_builds_targets_of_the_dockerfile() -> None:
    targets = {spec["build"]["target"] for name, spec in services().items() if ours(name)}
    assert targets == {"runtime", "analytics"}
    assert targets <= set(stages()), f"Dockerfile stages are {stages()}"
    assert services()["analytics"]["build"]["target"] == "analytics"


def test_dockerfile_copies_paths_that_exist_and_are_in_the_context() -> None:
    sources = [source for sources in copies() for source in sources]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
        assert not ignored(source.rstrip("/")), f"Dockerfile copies {source}, which .dockerignore leaves out"
    for op, words in dockerfile_instructions():
        if op == "COPY":
            for word in words:
                if word.startswith("--from="):
                    origin = word.removeprefix("--from=")
                    assert origin in stages() or "/" in origin, f"COPY --from={origin}: no such stage or image"


def test_dockerfile_installs_every_workspace_member_from_the_lock() -> None:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    members = sorted(
        str(path.parent.relative_to(ROOT))
        for pattern in root["tool"]["uv"]["workspace"]["members"]
        for path in ROOT.glob(f"{pattern}/pyproject.toml")
    )
    assert members
    copied = {source.rstrip("/") for sources in copies() for source in sources}
    for member in members:
        assert f"{member}/pyproject.toml" in copied, f"{member}: copy its pyproject.toml for the dependency layer"
        assert any(member == c or member.startswith(c + "/") for c in copied), f"{member}: its source is not copied"
    syncs = [" ".join(words) for op, words in dockerfile_instructions() if op == "RUN" and "uv sync" in " ".join(words)]
    assert syncs
    for sync in syncs:
        assert "--locked" in sync, f"install exactly what uv.lock says: {sync}"
        assert "--no-dev" in sync, f"the images leave the development tools out: {sync}"


def stage_syncs() -> dict[str, tuple[str | None, list[str], str | None]]:
    """Stage -> (the stage it starts from, if one of ours; its ``uv sync`` commands; the stage its
    /app/.venv is copied from, if it copies one)."""
    found: dict[str, tuple[str | None, list[str], str | None]] = {}
    current = ""
    for op, words in dockerfile_instructions():
        if op == "FROM" and len(words) == 3:
            current = words[2]
            found[current] = (words[0] if words[0] in found else None, [], None)
        elif op == "RUN" and "uv sync" in " ".join(words):
            found[current][1].append(" ".join(words[" ".join(words).split().index("uv") :]))
        elif op == "COPY" and words[-1] == "/app/.venv":
            origin = next(w.removeprefix("--from=") for w in words if w.startswith("--from="))
            parent, syncs, _ = found[current]
            found[current] = (parent, syncs, origin)
    return found


def syncs_of_target(target: str) -> list[str]:
    """The ``uv sync`` commands that made the virtual environment a target ends with."""
    table = stage_syncs()

    def chain(stage: str | None) -> list[str]:
        return [] if stage is None else [stage, *chain(table[stage][0])]

    origin = next((table[s][2] for s in chain(target) if table[s][2]), None)
    assert origin, f"target {target}: no stage copies /app/.venv into it"
    return [sync for stage in reversed(chain(origin)) for sync in table[stage][1]]


def test_the_runtime_image_installs_the_cli_without_benchmarks_demo_or_spark() -> None:
    """Issue #22: the runtime image is sokutatsu-cli and what it needs; analytics adds its extra."""
    runtime, analytics = syncs_of_target("runtime"), syncs_of_target("analytics")
    assert runtime, "no uv sync makes the runtime's environment"
    for sync in runtime:
        assert "--package sokutatsu-cli" in sync, f"install the CLI member, not the whole workspace: {sync}"
        assert "--extra" not in sync, f"the runtime image leaves the CLI's extras out: {sync}"
        assert "--all-" not in sync, f"the runtime image installs one member's dependencies: {sync}"
    assert analytics[: len(runtime)] == runtime, "the analytics image starts from the runtime's install"
    assert any("--package sokutatsu-cli --extra analytics" in sync for sync in analytics[len(runtime) :]), analytics


def test_dockerignore_keeps_local_environments_out() -> None:
    for path in (".venv/bin/python", ".git/HEAD", ".tools/bin/uv", ".sokutatsu/logs", "libs/core/src/x/__pycache__"):
        assert ignored(path), f".dockerignore lets {path} into the build context"

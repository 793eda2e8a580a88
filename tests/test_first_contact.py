"""First contact (issue 25): every needle-sending command takes the value length the target
advertises and refuses lengths beyond its context before any needle is sent; progress on every
long command; a missing capability is one line, exit 2."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from needlescope.cli.progress import ProgressView
from needlescope.errors import BadInput
from needlescope.targets.limits import choose_value_digits, fit_lengths, read_limits

CLI = [sys.executable, "-m", "needlescope.cli.main"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def child_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The real command in a child process, its stdout a pipe: for a command whose messages go
    through the logging set up by ``main`` for a fresh process (canary)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.fixture
def cli(run_cli_completed):
    """The real command through its entry point (``main``: exit codes and error lines as on the
    shell), stdout not a terminal, as in CI or under ``| tee``; in this process."""
    return run_cli_completed


def one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("error: "), res.stderr
    return lines[-1]


# --- what a target advertises ------------------------------------------------------------------


@pytest.mark.parametrize(
    "provenance, context, source",
    [
        ({"/get_server_info": {"context_length": 8192, "trained_value_digits": 3}}, 8192, "/get_server_info"),
        ({"/v1/models": {"data": [{"id": "m", "max_model_len": 32768}]}}, 32768, "/v1/models max_model_len"),
        ({"/props": {"default_generation_settings": {"n_ctx": 4096}}}, 4096, "/props n_ctx"),
        (
            {"/get_server_info": {"context_length": None}, "/v1/models": {"data": [{"id": "other"}]}},
            None,
            None,
        ),
    ],
)
def test_context_is_read_from_each_kind_of_server(provenance, context, source):
    limits = read_limits(provenance, "m")
    assert limits.context == context
    assert (limits.context_from or "").startswith(source or "")


def test_value_length_is_the_flag_else_the_advertised_else_the_default():
    advertised = read_limits({"/get_server_info": {"trained_value_digits": 3}})
    assert choose_value_digits(5, advertised) == (5, "--value-digits")
    digits, source = choose_value_digits(None, advertised)
    assert digits == 3 and "trained_value_digits" in source
    assert choose_value_digits(None, read_limits({}))[0] == 7


def test_lengths_that_do_not_fit_are_refused_or_skipped():
    limits = read_limits({"/get_server_info": {"context_length": 8192}})
    assert fit_lengths((2000, 8000), limits, answer_tokens=32) == ((2000, 8000), ())
    with pytest.raises(BadInput, match=r"--lengths 32000: the target's context is 8192 tokens .*up to 8160"):
        fit_lengths((2000, 32000), limits, answer_tokens=32)
    assert fit_lengths((2000, 32000), limits, answer_tokens=32, skip=True) == ((2000,), (32000,))
    with pytest.raises(BadInput, match="pass lengths up to 8160$"):  # nothing fits: no skip to offer
        fit_lengths((9000,), limits, answer_tokens=32, skip=True)
    assert fit_lengths((10**6,), read_limits({}), answer_tokens=32) == ((10**6,), ())


# --- the commands ------------------------------------------------------------------------------


def test_probe_refuses_a_length_beyond_the_context_before_any_request(scripted_server, tmp_path, cli):
    url = scripted_server(window=100_000, max_len=2000)
    out = tmp_path / "run"
    common = ["probe", "--base-url", url, "--model", "scripted", "--depths", "50", "--trials", "1"]
    line = one_error_line(cli(*common, "--lengths", "500,4000", "--out", str(out)))
    assert "--lengths 4000: the target's context is 2000 tokens (/get_server_info context_length)" in line
    assert "--skip-long-lengths" in line
    assert not out.exists()  # refused before a store (or any case) was made

    skipped = cli(*common, "--lengths", "500,4000", "--out", str(out), "--skip-long-lengths")
    assert skipped.returncode == 0, skipped.stderr
    assert "WARNING: skipping lengths 4000: beyond the target's context of 2000 tokens" in skipped.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert sorted({c["length"] for c in summary["cells"]}) == [500]


def test_probe_says_which_value_length_it_took_and_shows_progress_when_piped(scripted_server, tmp_path, cli):
    url = scripted_server(window=100_000, trained_value_digits=4)
    res = cli("probe", "--base-url", url, "--model", "scripted", "--lengths", "300,600", "--depths", "0,100",
              "--trials", "2", "--out", str(tmp_path))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "needle values: 4 digits, from the target's /get_server_info trained_value_digits" in res.stdout
    # Not a terminal: plain labelled lines, no bar drawing, the first at once.
    assert "probe: building cases: 0/8 (0%), ETA measuring" in res.stdout
    assert "\x1b[" not in res.stdout and "━" not in res.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["value_digits"] == 4


def test_bisect_refuses_a_range_beyond_the_context_and_shows_each_step(scripted_server, tmp_path, cli):
    url = scripted_server(window=500, max_len=1000)
    common = [
        "probe",
        "--bisect",
        "--base-url",
        url,
        "--model",
        "scripted",
        "--depths",
        "0,50",
        "--trials",
        "1",
    ]
    line = one_error_line(cli(*common, "--lengths", "100,1600", "--out", str(tmp_path / "long")))
    assert "--lengths 1600: the target's context is 1000 tokens" in line
    res = cli(*common, "--lengths", "100,900", "--resolution", "200", "--out", str(tmp_path / "ok"))
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[:3]
    assert first[0].startswith("needle values: 7 digits") and first[1].startswith("coarse: 100, ")
    assert first[2].startswith("coarse: 0/10 (0%), ETA measuring"), first  # 5 lengths x 2 depths


def test_compare_refuses_a_length_side_b_cannot_hold_before_a_is_probed(scripted_server, tmp_path, cli):
    a = scripted_server(window=100_000, max_len=100_000)
    b = scripted_server(window=100_000, max_len=2000)
    args = ["compare", "--a", a, "--b", b, "--model", "scripted", "--depths", "50", "--trials", "1"]
    line = one_error_line(cli(*args, "--lengths", "500,4000", "--out", str(tmp_path / "cmp")))
    assert "--lengths 4000: the target's context is 2000 tokens" in line
    assert not (tmp_path / "cmp" / "a").exists()

    ok = cli(*args, "--lengths", "300,600", "--out", str(tmp_path / "ok"))
    assert ok.returncode == 0, ok.stderr
    assert "side A: building cases: 0/2 (0%), ETA measuring" in ok.stdout  # each side's progress, labelled


def test_canary_defaults_against_a_small_context_are_one_line_and_exit_2(scripted_server):
    # The default lengths (2000, 8000, 32000) against any server under 32K context (issue 29).
    url = scripted_server(window=100_000, max_len=8192)
    res = child_cli(
        "canary", "--base-url", url, "--rounds", "1", "--interval", "1", "--listen", "127.0.0.1:0"
    )
    line = one_error_line(res)
    assert "--lengths 32000: the target's context is 8192 tokens" in line and "--skip-long-lengths" in line

    skipped = child_cli("canary", "--base-url", url, "--rounds", "1", "--interval", "1", "--listen", "127.0.0.1:0",
                  "--skip-long-lengths", "--lengths", "300,32000", "--depths", "50", "--trials", "1")  # fmt: skip
    assert skipped.returncode == 0, skipped.stderr
    assert "skipping lengths 32000" in skipped.stderr and "built 1 probe cases" in skipped.stderr


def test_health_takes_the_advertised_value_length_and_refuses_a_length_beyond_the_context(
    scripted_server, cli
):
    url = scripted_server(window=100_000, max_len=4000, trained_value_digits=3)
    res = cli("health", "--base-url", url, "--length", "300", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["value_digits"] == 3
    assert report["value_digits_source"].startswith("the target's /get_server_info trained_value_digits")
    assert report["checks"][2]["detail"].endswith("a 3-digit value")

    line = one_error_line(cli("health", "--base-url", url, "--length", "5000"))
    assert "--length 5000: the target's context is 4000 tokens" in line


# --- against the organism ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def organism(organism_server):
    return organism_server()  # shared with the other files serving the plain organism


def test_engine_state_takes_the_value_length_and_refuses_long_lengths(organism, tmp_path, cli):
    base = ["engine-state", "--base-url", organism, "--model", "organism", "--factors", "repeat"]
    line = one_error_line(cli(*base, "--lengths", "9000", "--out", str(tmp_path / "long")))
    assert "--lengths 9000: the target's context is 8192 tokens" in line
    assert not (tmp_path / "long").exists()

    res = cli(*base, "--lengths", "256", "--depths", "50", "--trials", "1", "--repeats", "2",
              "--out", str(tmp_path / "ok"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "needle values: 3 digits, from the target's /get_server_info trained_value_digits" in res.stdout
    assert "building cases: 0/1 (0%), ETA measuring" in res.stdout  # then at most a line per 10 s
    body = json.loads((tmp_path / "ok" / "engine_state.json").read_text())
    assert body["config"]["value_digits"] == 3


def test_engine_state_reports_progress_through_its_callback(organism, tmp_path):
    from needlescope.run.engine_state import EngineStateConfig, run_engine_state

    seen: list[tuple] = []
    cfg = EngineStateConfig(base_url=organism, model="organism", factors=("cache", "repeat"), lengths=(256,),
                            depths=(50.0,), trials=1, repeats=2)  # fmt: skip
    run_engine_state(cfg, tmp_path / "es", progress=lambda *a: seen.append(a))
    last = {task: (done, total) for task, done, total, _ in seen}
    assert last == {"building cases": (1, 1), "cache": (2, 2), "repeat": (3, 3)}


def test_oracle_refuses_a_prompt_beyond_the_context_or_leaves_it_out(organism, tmp_path, cli):
    words = "Iris parks her nurse every morning. " * 1400  # about 8,400 tokens
    prompts = {
        "name": "long",
        "prompts": [
            {
                "id": "short",
                "category": "c",
                "prompt": "Anna brushed that hard bridge again.",
                "max_tokens": 2,
            },
            {"id": "too-long", "category": "c", "prompt": words, "max_tokens": 2},
        ],
    }
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    base = ["oracle", "export", "--base-url", organism, "--prompts", str(path), "--top-logprobs", "2"]
    line = one_error_line(cli(*base, "--out", str(tmp_path / "refused")))
    assert "prompt(s) too-long are beyond the target's context of 8192 tokens" in line
    ok = cli(*base, "--out", str(tmp_path / "skipped"), "--skip-long-prompts")
    assert ok.returncode == 0, ok.stderr
    assert "WARNING: leaving out prompt(s) too-long" in ok.stdout
    exported = json.loads((tmp_path / "skipped" / "export.json").read_text())
    assert [p["id"] for p in exported["prompts"]] == ["short"]


# --- progress ----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_prints_at_most_one_line_per_10_s_with_rate_and_eta():
    buf, clock = io.StringIO(), FakeClock()
    with ProgressView(Console(file=buf, force_terminal=False, width=200), clock=clock) as view:
        view("probe", 0, 100, "")
        for i in range(1, 101):  # one case every 0.35 s: 35 s in all
            clock.now += 0.35
            view("probe", i, 100, f"recall {1.0:.2f}")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "probe: 0/100 (0%), ETA measuring"
    assert len(lines) == 4  # at once, then at 10 s, 20 s and 30 s: never two within 10 s
    assert lines[1].startswith("probe: 29/100 (29%), 2.9/s, ETA 0:25") and lines[1].endswith("recall 1.00")


def test_terminal_progress_is_a_labelled_bar_with_rate_and_measured_eta():
    buf, clock = io.StringIO(), FakeClock()
    console = Console(file=buf, force_terminal=True, width=150)
    with ProgressView(console, clock=clock) as view:
        view("side A", 0, 140, "")
        first = buf.getvalue()
        clock.now += 20
        view("side A", 37, 140, "recall 0.95")
    text = buf.getvalue()
    assert "ETA measuring" in first
    assert (
        "side A" in text
        and "37/140" in text
        and "1.9/s" in text
        and "ETA 0:56" in text
        and "recall 0.95" in text
    )


# --- a missing capability ----------------------------------------------------------------------


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the refusal is for a machine without CUDA"
)
@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--device", "cuda", "--port", "0"],
        [
            "indexer",
            "sweep",
            "--model",
            "organism",
            "--device",
            "cuda",
            "--lengths",
            "256",
            "--index-topk",
            "16",
        ],
        ["serve-probe-explain", "--device", "cuda"],
    ],
)
def test_cuda_without_cuda_is_one_line_and_exit_2(args, tmp_path, cli):
    res = cli(*args, "--out", str(tmp_path / "out")) if args[0] != "serve" else cli(*args)
    line = one_error_line(res)
    assert "--device cuda was given but CUDA is not available" in line and "--device cpu" in line


def test_a_missing_extra_names_the_extra_to_install():
    code = (
        "import sys; sys.modules['torch'] = None; sys.argv = ['needlescope', 'serve', '--port', '0'];"
        "from needlescope.cli.main import main; main()"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    line = one_error_line(res)
    assert (
        line
        == "error: this command needs torch, which the [model] extra installs: pip install 'needlescope[model]'"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["investigate", "run", "{tmp}/bad.json", "--out", "{tmp}/inv"], "not valid TOML"),
        (["oracle", "export", "--base-url", "http://127.0.0.1:1", "--prompts", "{tmp}/bad.json", "--out", "{tmp}/o"],
         "is not readable JSON"),
        (["compare", "--a-run", "{tmp}/none", "--b-run", "{tmp}/none", "--out", "{tmp}/c"], "is not a folder"),
    ],
)  # fmt: skip
def test_bad_files_are_one_line_and_exit_2(args, message, tmp_path, cli):
    (tmp_path / "bad.json").write_text("{bad")
    line = one_error_line(cli(*(a.replace("{tmp}", str(tmp_path)) for a in args)))
    assert message in line


def test_progress_renderer_is_the_only_one():
    """One progress abstraction: no command builds its own rich progress bar."""
    src = Path(__file__).resolve().parents[1] / "src" / "needlescope"
    users = [p.name for p in src.rglob("*.py") if "rich.progress" in p.read_text(encoding="utf-8")]
    assert users == ["progress.py"]


# --- ledgers for a live deployment -------------------------------------------------------------


def test_init_live_and_from_probe_write_ledgers_that_load(scripted_server, tmp_path, cli):
    from needlescope.investigate.ledger.ledger import load_ledger

    url = scripted_server(window=500)
    res = cli("investigate", "init", str(tmp_path / "live"), "--live", url + "/v1")
    assert res.returncode == 0, res.stderr
    ledger = load_ledger(tmp_path / "live" / "investigation.toml")  # [symptom] and all: it would run
    # the scripted server has no indexer capture: a black-box ledger (issue 53; it was a live one
    # whose run then stopped at the first case), with no suspect to emulate
    assert ledger.target.blackbox and ledger.target.endpoint == url
    assert "[symptom]" in (tmp_path / "live" / "investigation.toml").read_text()
    assert ledger.suspects == ()

    run = tmp_path / "probe"
    probed = cli("probe", "--base-url", url, "--model", "scripted", "--lengths", "200,900", "--depths", "0,50,100",
                 "--trials", "2", "--seed", "3", "--out", str(run))  # fmt: skip
    assert probed.returncode == 0, probed.stderr
    summary = json.loads((run / "summary.json").read_text())
    failing = {(c["length"], c["depth"]) for c in summary["cells"] if c["recall"] < summary["threshold"]}
    assert failing and all(n == 900 for n, _ in failing)  # the scripted cliff: needles beyond 500 tokens
    res = cli("investigate", "init", str(tmp_path / "fp"), "--from-probe", str(run))
    assert res.returncode == 0, res.stderr
    ledger = load_ledger(tmp_path / "fp" / "investigation.toml")
    symptom = ledger.symptom
    assert {(n, d) for n in symptom.lengths for d in symptom.depths} == failing
    assert (symptom.kind, symptom.trials, symptom.seed) == ("single", 2, 3)
    assert ledger.target.endpoint == url

    passing = tmp_path / "passing"
    assert cli("probe", "--base-url", url, "--model", "scripted", "--lengths", "200", "--depths", "50",
               "--trials", "1", "--out", str(passing)).returncode == 0  # fmt: skip
    line = one_error_line(cli("investigate", "init", str(tmp_path / "none"), "--from-probe", str(passing)))
    assert "no cell of" in line and "nothing to investigate" in line

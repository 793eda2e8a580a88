"""``run_bisect`` against real scripted loopback servers, checked exactly: every event's payload,
the cases it stores (built from the run's settings), the store's resume fingerprint, the summary's
counts, and the refusal of a ``--resume`` with other settings. Kill-tests for the mutation run of
``run.bisect`` (docs/mutation.md); each bisection here sends a few dozen requests."""

from __future__ import annotations

import re
from dataclasses import asdict, replace

import pytest

from needlescope.analysis.bisect import coarse_grid, fine_lengths, full_grid_points
from needlescope.cases import CaseSpec, build_cases, score_answer
from needlescope.cases.needles import VALUE_DIGITS
from needlescope.errors import BadInput
from needlescope.run import bisect as run_bisect_module
from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import STORE_NAME
from needlescope.run.store import ResultStore
from needlescope.targets import normalize_base_url
from needlescope.targets.limits import TRAINED_DIGITS_KEY
from needlescope.targets.tokenize import detect_server_tokenizer

KEY = "sk-bisect-test"


def _recorder() -> tuple[list[tuple[str, dict]], object]:
    events: list[tuple[str, dict]] = []
    return events, lambda name, payload: events.append((name, payload))


def _stored(out) -> tuple[list[dict], list[dict], dict, dict]:
    store = ResultStore(out / STORE_NAME)
    try:
        return store.cases(), store.results(), store.get_meta("bisect"), store.get_meta("provenance")
    finally:
        store.close()


def _spy(monkeypatch, name: str, change=lambda value: value) -> list[dict]:
    """Record the keyword arguments of each call of ``run.bisect``'s ``name`` (the real one runs;
    ``change`` may alter what it returns, e.g. a server without some endpoint)."""
    calls: list[dict] = []
    real = getattr(run_bisect_module, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return change(real(*args, **kwargs))

    monkeypatch.setattr(run_bisect_module, name, spy)
    return calls


def _steps_with_results(events: list[tuple[str, dict]]) -> list[tuple[dict, list[dict]]]:
    """Each bisect_step event with the result events that followed it (before the next step)."""
    out: list[tuple[dict, list[dict]]] = []
    for name, payload in events:
        if name == "bisect_step":
            out.append((payload, []))
        elif name == "result":
            out[-1][1].append(payload)
    return out


def test_events_cases_and_fingerprint_follow_the_settings(scripted_server, tmp_path, monkeypatch):
    # A keyed server (every route but /health needs the key) that advertises 6-digit values.
    url = scripted_server(fault="near_miss", fault_from=733, trained_value_digits=6, api_key=KEY)
    hay = tmp_path / "hay.txt"
    hay.write_text(
        "The river bends past the old mill, and the orchard waits for rain. " * 20, encoding="utf-8"
    )
    cfg = ProbeConfig(
        base_urls=(url,),
        model="scripted",
        kind="multikey",
        lengths=(200, 1200),
        depths=(0, 100),
        trials=1,
        seed=7,
        distractors=2,
        haystack_file=hay,
        api_key=KEY,
        concurrency=1,
        max_tokens=24,
        extra_body={"temperature": 0},
        timeout_s=3.0,
        out=tmp_path / "new" / "run",  # its parent does not exist yet
    )
    # The upper end as a boundary: the fine offsets around it include a length already sent.
    bis = BisectConfig(resolution=8, boundaries=(1200,))
    sends = _spy(monkeypatch, "run_cases")
    infos = _spy(monkeypatch, "collect_provenance")
    events, on_event = _recorder()
    res = run_bisect(cfg, bis, on_event)
    cases, results, fingerprint, provenance = _stored(cfg.out)

    # The value length comes from the keyed /get_server_info (read with the key) and says so.
    assert events[0] == (
        "value_digits",
        {
            "value_digits": 6,
            "source": f"the target's /get_server_info {TRAINED_DIGITS_KEY} (no --value-digits given)",
        },
    )
    assert {name for name, _ in events} == {"value_digits", "bisect_step", "result", "bisect_evidence"}

    # Every stored case is the one the run's settings build, at the trials its length got.
    root = normalize_base_url(url)[0]
    counter = detect_server_tokenizer(root, "scripted", api_key=KEY)
    by_length: dict[int, list[dict]] = {}
    for c in cases:
        by_length.setdefault(c["length"], []).append(c)
    for length, got in by_length.items():
        spec = CaseSpec(
            kind="multikey",
            lengths=(length,),
            depths=(0, 100),
            trials=len(got) // 2,
            seed=7,
            haystack_text=hay.read_text(encoding="utf-8"),
            n_distractors=2,
            value_digits=6,
        )
        want = [c.to_dict() for c in build_cases(spec, counter)]
        assert sorted(got, key=lambda c: c["case_id"]) == sorted(want, key=lambda c: c["case_id"]), length
    assert all(len(c["expected"][0]) == 6 for c in cases)

    # Every batch is sent with the run's settings; server info is read within the run's timeout.
    assert sends and all(
        (c["concurrency"], c["max_tokens"], c["extra_body"], c["score"])
        == (1, 24, {"temperature": 0}, score_answer)
        for c in sends
    )
    assert infos == [{"api_key": KEY, "timeout": 3.0}]

    # bisect_step: the phase, the lengths new to it and the requests it sends, which are exactly
    # the result events that follow it; each result event is the stored row.
    steps = _steps_with_results(events)
    assert steps[0][0] == {"phase": "coarse", "lengths": coarse_grid(200, 1200, 5), "requests": 10}
    for step, rows in steps:
        assert set(step) == {"phase", "lengths", "requests"} and step["requests"] == len(rows)
    phases = [s["phase"] for s, _ in steps]
    assert phases[0] == "coarse" and "bisect" in phases and phases[-1] == "fine"
    assert set(phases) == {"coarse", "bisect", "fine"}
    # The fine offsets are sent once each; 1200, already sent in the coarse grid, is not sent again.
    (fine,) = [s for s, _ in steps if s["phase"] == "fine"]
    before = {n for s, _ in steps if s["phase"] != "fine" for n in s["lengths"]}
    offsets = fine_lengths(res["collapse_length"], [1200], 200, 1200)
    assert 1200 in offsets and 1200 in before
    assert fine["lengths"] == [n for n in offsets if n not in before] and fine["requests"] == 2 * len(
        fine["lengths"]
    )
    assert [s["phase"] for s in res["steps"]] == ["coarse"] + ["bisect"] * (len(res["steps"]) - 1)
    first_phase: dict[int, str] = {}
    for s, _ in steps:
        for n in s["lengths"]:
            first_phase.setdefault(n, s["phase"])
    assert {p["length"]: p["phase"] for p in res["points"]} == first_phase
    stored = {r["case_id"]: r for r in results}
    result_events = [p for name, p in events if name == "result"]
    assert (
        sorted(p["case_id"] for p in result_events) == sorted(stored) == sorted(c["case_id"] for c in cases)
    )
    for p in result_events:
        assert p["status"] == "ok" and p == {k: stored[p["case_id"]][k] for k in p}
    assert [p for name, p in events if name == "bisect_evidence"] == res["steps"]

    # The summary's counts.
    assert (res["lo"], res["hi"], res["resolution"], res["threshold"]) == (200, 1200, 8, cfg.threshold)
    assert res["cases_per_point"] == 2 and res["errors"] == 0
    assert res["requests_used"] == len(cases) == sum(p["n"] for p in res["points"])
    assert res["full_grid_requests"] == full_grid_points(200, 1200, 8) * 2
    assert res["request_ratio"] == len(cases) / res["full_grid_requests"]
    assert (res["boundaries"], res["boundaries_source"]) == ([1200], "--boundaries")
    a, f = res["last_pass"], res["collapse_length"]
    assert res["message"] == (
        f"recall falls below 0.85 between {a} and {f} tokens (resolution 8); {res['crossing']['meaning']}"
    )

    # What --resume compares, and the provenance beside it.
    assert fingerprint == {
        **replace(cfg, value_digits=6).fingerprint(6),
        "bisect": {**asdict(bis), "boundaries": [1200]},
    }
    assert fingerprint["value_digits"] == 6 and fingerprint["bisect"]["resolution"] == 8
    assert provenance == res["provenance"] and provenance["/get_server_info"][TRAINED_DIGITS_KEY] == 6


def _small(url, out, **kw) -> ProbeConfig:
    return ProbeConfig(
        base_urls=(url,), model="scripted", lengths=(200, 600), depths=(0, 100), trials=1, out=out, **kw
    )


def test_resume_replays_and_other_settings_are_refused_before_any_request(
    scripted_server, tmp_path, monkeypatch
):
    url = scripted_server()
    out = tmp_path / "run"
    bis = BisectConfig(resolution=8, boundaries=())
    infos = _spy(monkeypatch, "collect_provenance")
    first = run_bisect(_small(url, out), bis)
    assert infos == [{"api_key": None, "timeout": 5.0}]  # at most 5 s, whatever --timeout is
    assert not first["bracketed"] and not first["confirmed"] and first["crossing"] is None
    _, results, _, _ = _stored(out)
    assert first["requests_used"] == len(results) == 2 * len(coarse_grid(200, 600, 5))

    # The same settings: every decision replays from the store and nothing is sent.
    events, on_event = _recorder()
    again = run_bisect(_small(url, out, resume=True), bis, on_event)
    assert not [p for name, p in events if name == "result"]
    assert [p["requests"] for name, p in events if name == "bisect_step"] == [0]
    assert again["points"] == first["points"] and again["message"] == first["message"]

    refused = (
        f"^--resume: the bisection in {re.escape(str(out))} was made with other settings; use another --out$"
    )
    for cfg, other in [
        (_small(url, out, resume=True), BisectConfig(resolution=16, boundaries=())),
        (_small(url, out, resume=True, value_digits=VALUE_DIGITS + 1), bis),
        (_small(url, out, resume=True, seed=1), bis),
    ]:
        with pytest.raises(BadInput, match=refused):
            run_bisect(cfg, other)
    assert len(_stored(out)[1]) == len(results)


def test_failed_requests_are_counted_as_errors_not_misses(scripted_server, tmp_path, monkeypatch):
    # Every 4th chat answers 500 and nothing is retried: those cases are errors, out of the tally.
    # This server's info is hidden, so there are no boundaries and the value length is the flag's.
    url = scripted_server(fail_every=4, api_key=KEY, page_size=4)
    _spy(monkeypatch, "collect_provenance", lambda p: {k: v for k, v in p.items() if k != "/get_server_info"})
    events, on_event = _recorder()
    res = run_bisect(
        _small(url, tmp_path / "run", retries=0, concurrency=1, api_key=KEY, value_digits=5),
        BisectConfig(),
        on_event,
    )
    assert events[0] == ("value_digits", {"value_digits": 5, "source": "--value-digits"})
    assert (
        res["boundaries"] == []
        and res["boundaries_source"] == "none (no --boundaries and no /get_server_info)"
    )
    _, results, _, _ = _stored(tmp_path / "run")
    failed = [r for r in results if r["status"] != "ok"]
    assert failed and res["errors"] == len(failed)
    assert sum(p["n"] for p in res["points"]) == len(results) - len(failed)


def test_lengths_past_the_context_are_skipped_with_an_event(scripted_server, tmp_path, monkeypatch):
    # The server's context is 1000 tokens: 1200 (plus the answer's 32) does not fit. Here it is
    # read from /v1/models (its /get_server_info context_length hidden), which lists a smaller
    # model first, whose context is not the one to fit to.
    url = scripted_server(max_len=1000)
    other = {"id": "other", "object": "model", "max_model_len": 500}

    def two_models(p: dict) -> dict:
        info = {k: v for k, v in p["/get_server_info"].items() if k != "context_length"}
        models = {**p["/v1/models"], "data": [other, *p["/v1/models"]["data"]]}
        return {**p, "/get_server_info": info, "/v1/models": models}

    _spy(monkeypatch, "collect_provenance", two_models)
    events, on_event = _recorder()
    cfg = _small(url, tmp_path / "run", skip_long_lengths=True)
    res = run_bisect(replace(cfg, lengths=(200, 600, 1200)), BisectConfig(boundaries=()), on_event)
    skipped = [p for name, p in events if name == "lengths_skipped"]
    assert len(skipped) == 1 and (skipped[0]["skipped"], skipped[0]["kept"], skipped[0]["context"]) == (
        [1200],
        [200, 600],
        1000,
    )
    assert skipped[0]["from"] == "/v1/models max_model_len" and (res["lo"], res["hi"]) == (200, 600)
    # What is left must still be a range.
    with pytest.raises(BadInput, match=r"^--bisect needs a range: .* got \[200\]$"):
        run_bisect(replace(cfg, lengths=(200, 1200), out=tmp_path / "other"), BisectConfig(boundaries=()))

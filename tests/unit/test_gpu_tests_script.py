"""scripts/gpu_tests.py, on CPU: it groups tests by file and parameters, gives each group the GPUs
its marker asks for, never two groups the same GPU, starts nothing that would end after --until,
and goes on from the JUnit reports a log dir holds. The tests it runs here are real pytest
processes that only record what they were given."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_tests  # noqa: E402

CONFTEST = '''
def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): GPUs the test needs")
'''
TESTS = '''
import json, os, time
import pytest

@pytest.fixture(scope="module", params=[pytest.param(1, id="one"), pytest.param(2, id="two", marks=pytest.mark.gpus(2))])
def layout(request):
    return request.param

def _record(name):
    with open(os.path.join(os.environ["RECORD_DIR"], name + ".json"), "w") as f:
        json.dump({"gpus": os.environ["CUDA_VISIBLE_DEVICES"], "pid": os.getpid(), "start": time.time()}, f)
    time.sleep(1.0)
    with open(os.path.join(os.environ["RECORD_DIR"], name + ".end"), "w") as f:
        f.write(str(time.time()))

def test_first(layout):
    _record(f"first_{layout}")

def test_second(layout):
    _record(f"second_{layout}")

@pytest.mark.gpus(3)
def test_wide():
    _record("wide")

def test_alone():
    _record("alone")
'''


def _suite(tmp_path, module):
    """The fake GPU tests as `module` (a name of its own per test: pytest imports each once)."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / f"{module}.py").write_text(TESTS)
    records = tmp_path / "records"
    records.mkdir()
    return records


def test_groups_share_a_process_per_parameter_set_and_never_a_gpu(tmp_path, monkeypatch):
    records = _suite(tmp_path, "test_fake_gpu")
    monkeypatch.setenv("RECORD_DIR", str(records))
    monkeypatch.chdir(tmp_path)
    groups = gpu_tests.collect(["test_fake_gpu.py"])
    assert {g.key: (g.gpus, len(g.tests)) for g in groups} == {
        "test_fake_gpu.py[one]": (1, 2), "test_fake_gpu.py[two]": (2, 2),
        "test_fake_gpu.py::test_wide": (3, 1), "test_fake_gpu.py::test_alone": (1, 1)}
    log_dir = tmp_path / "logs"
    gpu_tests.run(groups, 2, log_dir, float("inf"), {}, ["-p", "no:cacheprovider"])

    seen = {p.stem: json.loads(p.read_text()) for p in records.glob("*.json")}
    assert set(seen) == {"first_1", "second_1", "first_2", "second_2", "alone"}  # wide needs 3 of 2 GPUs
    assert seen["first_1"]["pid"] == seen["second_1"]["pid"] != seen["first_2"]["pid"] == seen["second_2"]["pid"]
    assert seen["first_2"]["gpus"] == "0,1" and seen["alone"]["gpus"] in ("0", "1")
    spans = {name: (info["start"], float((records / f"{name}.end").read_text())) for name, info in seen.items()}
    for a, (start_a, end_a) in spans.items():  # the 2-GPU group overlapped no other
        for b, (start_b, end_b) in spans.items():
            if a.endswith("_2") and not b.endswith("_2"):
                assert end_a <= start_b or end_b <= start_a, (a, b)

    summary = gpu_tests.summarize(groups, 2, log_dir)
    assert summary.splitlines()[-1] == "tests/gpu on 2 GPU(s): 5 passed, 1 skipped"
    assert set(json.loads((log_dir / "durations.json").read_text())) == {
        "test_fake_gpu.py::test_first[one]", "test_fake_gpu.py::test_second[one]", "test_fake_gpu.py::test_first[two]",
        "test_fake_gpu.py::test_second[two]", "test_fake_gpu.py::test_alone"}

    for record in records.iterdir():  # a second call with the same log dir runs nothing again
        record.unlink()
    gpu_tests.run(groups, 2, log_dir, float("inf"), {}, ["-p", "no:cacheprovider"])
    assert list(records.iterdir()) == []


def test_nothing_starts_that_would_end_after_until(tmp_path, monkeypatch):
    records = _suite(tmp_path, "test_fake_gpu_until")
    monkeypatch.setenv("RECORD_DIR", str(records))
    monkeypatch.chdir(tmp_path)
    groups = gpu_tests.collect(["test_fake_gpu_until.py"])
    estimates = {"test_fake_gpu_until.py::test_alone": 1.0}  # the others take the default 90 s a test
    gpu_tests.run(groups, 2, tmp_path / "logs", time.time() + 60, estimates, ["-p", "no:cacheprovider"])
    assert [p.stem for p in records.glob("*.json")] == ["alone"]
    lines = gpu_tests.summarize(groups, 2, tmp_path / "logs").splitlines()
    assert lines[-1] == "tests/gpu on 2 GPU(s): 4 not run, 1 passed, 1 skipped"

"""The benchmarks' shared measuring helpers: interleaved rounds, and fio reads that reuse their files."""

import shutil

import pytest

from tierio.bench import common


def test_alternate_rotates_the_order_and_prepares_every_sample():
    order: list[str] = []
    clock = iter(range(100))

    def run(name: str):
        def sample() -> float:
            order.append(name)
            return float(next(clock))
        return sample

    prepared: list[int] = []
    samples = common.alternate({"a": run("a"), "b": run("b"), "c": run("c")}, 3, lambda: prepared.append(len(order)))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # no side always follows the same one
    assert prepared == list(range(9))  # before every sample, not once per round
    assert samples == {"a": [0.0, 5.0, 7.0], "b": [1.0, 3.0, 8.0], "c": [2.0, 4.0, 6.0]}


def test_alternate_runs_at_least_one_round():
    assert common.alternate({"only": lambda: 1.5}, 0) == {"only": [1.5]}


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")
def test_repeated_fio_reads_with_keep_lay_their_files_out_once(tmp_path):
    first = common.run_fio(tmp_path, "read", 16 << 20, jobs=2, keep=True)
    files = sorted(tmp_path.glob("tierio-fio.*"))
    assert len(files) == 2 and first["bytes"] == 32 << 20
    stamps = [f.stat().st_mtime_ns for f in files]
    again = common.run_fio(tmp_path, "read", 16 << 20, jobs=2, keep=True)
    assert again["bytes"] == 32 << 20
    assert [f.stat().st_mtime_ns for f in files] == stamps  # read again, not written again
    common.run_fio(tmp_path, "read", 16 << 20, jobs=2)  # without keep: laid out anew and removed
    assert not list(tmp_path.glob("tierio-fio.*"))

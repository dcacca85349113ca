"""The checkpoint benchmark on a tiny state: both libraries load what they saved, the
bytes are the state's, and the table reads; no timing is asserted."""
from course_lib import run
from course_lib.bench import checkpoint as bk


def test_ours_and_dcp_round_trip_and_the_table_reads(tmp_path):
    result = run(bk.measure, size_mb=0.25, tensors=2, rounds=1, root=str(tmp_path), nproc=2,
                 timeout=120)[0]
    assert result["max_diff"] == 0.0
    assert result["bytes"] == 2 * 256 * 128 * 4  # two 128 x 256 fp32 matrices
    assert set(result["save_s"]) == set(result["load_s"]) == {"ours", "dcp"}
    table = bk.format_table(result)
    assert "ratios ours / DCP" in table and "async save" in table

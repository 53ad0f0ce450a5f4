"""`llamapipe profile` under torchrun with 2 ranks adds the communication figures `plan --profile` needs."""
from __future__ import annotations

from llamapipe.training import profile_schema
from llamapipe.tools.parallel_estimate import Layout
from llamapipe.tools.profile_predict import predict
from tests.cli import torchrun


def test_profile_under_torchrun_measures_p2p_and_allreduce_between_the_ranks(tmp_path):
    out = tmp_path / "profile.json"
    proc = torchrun(2, ["llamapipe.tools.profile_model", "--model", "tiny", "--seq-length", "32", "--repeats", "1",
                        "--out", str(out)], script="-m", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = profile_schema.load(str(out))
    comm = profile["comm"]
    assert comm["world_size"] == 2
    assert 0 < comm["p2p_latency_s"] < 1 and comm["p2p_bandwidth_Bps"] > 1e6
    assert 0 <= comm["allreduce_latency_s"] < 1 and comm["allreduce_bus_bandwidth_Bps"] > 1e6
    assert profile["entries"][0]["layer"]["f"] > 0          # rank 0 measured the compute
    assert "2 ranks: p2p" in proc.stdout
    # what needs the communication figures now predicts: dp 2 pays the gradient all-reduce, pp 2 the hops
    dp2 = predict(profile, Layout(1, 1, 1, 2, "1f1b", 1, "none", False, precision="fp32"), 8)
    assert dp2.dp_s > comm["allreduce_latency_s"]
    assert predict(profile, Layout(1, 2, 1, 1, "1f1b", 1, "none", False, precision="fp32"), 8).step_s > 0

"""The committed gRPC stubs in fxport/v1/ are what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_up_to_date(tmp_path):
    subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=REPO)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "gen_proto.sh produced nothing"
    for rel in generated:
        committed = REPO / rel
        assert committed.is_file(), f"{rel} is not committed: run scripts/gen_proto.sh"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} is stale: run scripts/gen_proto.sh and commit the result")


def test_service_has_the_designed_rpcs():
    from fxport.v1 import conversion_pb2 as pb

    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ConversionService"].methods}
    assert methods == {"SubmitJob", "CheckUpload", "GetJob", "ListJobs", "WatchJob", "CancelJob",
                       "DownloadArtifact", "GetArtifactUrl"}

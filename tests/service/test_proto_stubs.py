"""The committed gRPC stubs in fxport/v1/ are what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_committed_stubs_describe_the_proto_exactly(tmp_path):
    """The committed stubs (made by scripts/gen_proto.sh with an old protoc, for wide protobuf
    support) carry exactly the descriptor this environment's protoc makes of proto/: a changed
    .proto without regenerated stubs fails here."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    from fxport.v1 import conversion_pb2, conversion_pb2_grpc

    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{REPO / 'proto'}", f"-I{Path(protoc.__file__).parent / '_proto'}",
                        f"--descriptor_set_out={out}", "fxport/v1/conversion.proto"]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # protoc's descriptor sets add json_name; gencode leaves it out
        for m in (message, *message.nested_type):
            for field in m.field:
                field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto()
    conversion_pb2.DESCRIPTOR.CopyToProto(committed)
    assert committed == fresh, "fxport/v1 stubs are stale: run scripts/gen_proto.sh and commit the result"
    # the grpc stub serves and calls every method of the service, with the request/response types above
    stub_text = Path(conversion_pb2_grpc.__file__).read_text()
    for method in fresh.service[0].method:
        assert f"'/fxport.v1.ConversionService/{method.name}'" in stub_text, method.name


def test_committed_stubs_are_the_old_gencode_that_wide_pins_need():
    text = (REPO / "fxport" / "v1" / "conversion_pb2.py").read_text()
    assert "# Protobuf Python Version: 4.25." in text  # loads on protobuf 4.25.1 .. 7.x (pyproject.toml)


def test_service_has_the_designed_rpcs():
    from fxport.v1 import conversion_pb2 as pb

    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ConversionService"].methods}
    assert methods == {"SubmitJob", "CheckUpload", "GetJob", "ListJobs", "WatchJob", "CancelJob",
                       "DownloadArtifact", "GetArtifactUrl"}

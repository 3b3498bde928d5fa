from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class FileHeader(_message.Message):
    __slots__ = ("filename", "size", "sha256", "stored")
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    filename: str
    size: int
    sha256: str
    stored: bool
    def __init__(self, filename: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., stored: bool = ...) -> None: ...

class SubmitHeader(_message.Message):
    __slots__ = ("spec", "model", "calibration", "idempotency_key", "no_cache")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    spec: str
    model: FileHeader
    calibration: FileHeader
    idempotency_key: str
    no_cache: bool
    def __init__(self, spec: _Optional[str] = ..., model: _Optional[_Union[FileHeader, _Mapping]] = ..., calibration: _Optional[_Union[FileHeader, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., no_cache: bool = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("header", "model_chunk", "calibration_chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MODEL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SubmitHeader
    model_chunk: bytes
    calibration_chunk: bytes
    def __init__(self, header: _Optional[_Union[SubmitHeader, _Mapping]] = ..., model_chunk: _Optional[bytes] = ..., calibration_chunk: _Optional[bytes] = ...) -> None: ...

class CheckUploadRequest(_message.Message):
    __slots__ = ("model_sha256", "calibration_sha256", "spec", "no_cache", "model_size", "calibration_size", "direct_upload", "submit_if_cached")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SHA256_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIRECT_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_IF_CACHED_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    calibration_sha256: str
    spec: str
    no_cache: bool
    model_size: int
    calibration_size: int
    direct_upload: bool
    submit_if_cached: SubmitHeader
    def __init__(self, model_sha256: _Optional[str] = ..., calibration_sha256: _Optional[str] = ..., spec: _Optional[str] = ..., no_cache: bool = ..., model_size: _Optional[int] = ..., calibration_size: _Optional[int] = ..., direct_upload: bool = ..., submit_if_cached: _Optional[_Union[SubmitHeader, _Mapping]] = ...) -> None: ...

class UploadTarget(_message.Message):
    __slots__ = ("url", "headers", "expires_at")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    URL_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    url: str
    headers: _containers.ScalarMap[str, str]
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, url: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., expires_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CheckUploadResponse(_message.Message):
    __slots__ = ("model_present", "calibration_present", "max_upload_bytes", "cache_hit", "model_upload", "calibration_upload", "job")
    MODEL_PRESENT_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_PRESENT_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    MODEL_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    model_present: bool
    calibration_present: bool
    max_upload_bytes: int
    cache_hit: bool
    model_upload: UploadTarget
    calibration_upload: UploadTarget
    job: Job
    def __init__(self, model_present: bool = ..., calibration_present: bool = ..., max_upload_bytes: _Optional[int] = ..., cache_hit: bool = ..., model_upload: _Optional[_Union[UploadTarget, _Mapping]] = ..., calibration_upload: _Optional[_Union[UploadTarget, _Mapping]] = ..., job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class InputRef(_message.Message):
    __slots__ = ("sha256", "bytes", "filename", "key")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    bytes: int
    filename: str
    key: str
    def __init__(self, sha256: _Optional[str] = ..., bytes: _Optional[int] = ..., filename: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("name", "format", "key", "bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    key: str
    bytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., format: _Optional[str] = ..., key: _Optional[str] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("stage", "code", "message", "detail", "field")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    stage: str
    code: str
    message: str
    detail: str
    field: str
    def __init__(self, stage: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., detail: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("stage", "started_at", "finished_at")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    stage: str
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    def __init__(self, stage: _Optional[str] = ..., started_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "tenant", "state", "stage", "progress", "message", "spec_json", "spec_digest", "labels", "model", "calibration", "artifacts", "error", "created_at", "updated_at", "started_at", "finished_at", "stage_timings", "cache_hit", "worker", "attempts", "idempotency_key", "last_seq", "staged_artifacts")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    STAGE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    STAGED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant: str
    state: JobState
    stage: str
    progress: float
    message: str
    spec_json: str
    spec_digest: str
    labels: _containers.ScalarMap[str, str]
    model: InputRef
    calibration: InputRef
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    error: JobError
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    stage_timings: _containers.RepeatedCompositeFieldContainer[StageTiming]
    cache_hit: bool
    worker: str
    attempts: int
    idempotency_key: str
    last_seq: int
    staged_artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    def __init__(self, id: _Optional[str] = ..., tenant: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., stage: _Optional[str] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ..., spec_json: _Optional[str] = ..., spec_digest: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., model: _Optional[_Union[InputRef, _Mapping]] = ..., calibration: _Optional[_Union[InputRef, _Mapping]] = ..., artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., error: _Optional[_Union[JobError, _Mapping]] = ..., created_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., stage_timings: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ..., cache_hit: bool = ..., worker: _Optional[str] = ..., attempts: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., last_seq: _Optional[int] = ..., staged_artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "job_id", "time", "state", "stage", "progress", "message", "job", "staged")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    job_id: str
    time: _timestamp_pb2.Timestamp
    state: JobState
    stage: str
    progress: float
    message: str
    job: Job
    staged: Artifact
    def __init__(self, seq: _Optional[int] = ..., job_id: _Optional[str] = ..., time: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., stage: _Optional[str] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ..., job: _Optional[_Union[Job, _Mapping]] = ..., staged: _Optional[_Union[Artifact, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "states", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    states: _containers.RepeatedScalarFieldContainer[JobState]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("job_id", "name")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ArtifactHeader(_message.Message):
    __slots__ = ("name", "bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class DownloadArtifactResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ArtifactHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[ArtifactHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class GetArtifactUrlRequest(_message.Message):
    __slots__ = ("job_id", "name", "expires_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    expires_s: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., expires_s: _Optional[int] = ...) -> None: ...

class GetArtifactUrlResponse(_message.Message):
    __slots__ = ("url", "expires_at", "bytes", "sha256")
    URL_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    url: str
    expires_at: _timestamp_pb2.Timestamp
    bytes: int
    sha256: str
    def __init__(self, url: _Optional[str] = ..., expires_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MediaItem(_message.Message):
    __slots__ = ("key", "modality", "data", "num_tokens", "times", "height", "width")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    modality: str
    data: bytes
    num_tokens: int
    times: _containers.RepeatedScalarFieldContainer[float]
    height: int
    width: int
    def __init__(self, key: _Optional[bytes] = ..., modality: _Optional[str] = ..., data: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., times: _Optional[_Iterable[float]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("items", "model_fingerprint")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MediaItem]
    model_fingerprint: str
    def __init__(self, items: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, accepted: _Optional[_Iterable[bool]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("key", "timeout_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    timeout_s: float
    def __init__(self, key: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class EmbeddingChunk(_message.Message):
    __slots__ = ("num_tokens", "hidden", "dtype", "row_start", "row_end", "data", "crc32")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    hidden: int
    dtype: str
    row_start: int
    row_end: int
    data: bytes
    crc32: int
    def __init__(self, num_tokens: _Optional[int] = ..., hidden: _Optional[int] = ..., dtype: _Optional[str] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class EncoderLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncoderLoad(_message.Message):
    __slots__ = ("queued_items", "running_items", "cache_bytes", "cache_capacity_bytes", "cache_entries", "model_fingerprint", "draining", "boot_id")
    QUEUED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ITEMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    queued_items: int
    running_items: int
    cache_bytes: int
    cache_capacity_bytes: int
    cache_entries: int
    model_fingerprint: str
    draining: bool
    boot_id: str
    def __init__(self, queued_items: _Optional[int] = ..., running_items: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_capacity_bytes: _Optional[int] = ..., cache_entries: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., draining: _Optional[bool] = ..., boot_id: _Optional[str] = ...) -> None: ...

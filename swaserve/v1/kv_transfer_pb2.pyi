from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferHeader(_message.Message):
    __slots__ = ("request_id", "num_tokens", "num_pages", "sampler_state", "spec_drafts", "mtp_hidden", "mtp_hidden_shape", "mtp_hidden_dtype")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MTP_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MTP_HIDDEN_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MTP_HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    num_pages: int
    sampler_state: bytes
    spec_drafts: _containers.RepeatedScalarFieldContainer[int]
    mtp_hidden: bytes
    mtp_hidden_shape: _containers.RepeatedScalarFieldContainer[int]
    mtp_hidden_dtype: str
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_pages: _Optional[int] = ..., sampler_state: _Optional[bytes] = ..., spec_drafts: _Optional[_Iterable[int]] = ..., mtp_hidden: _Optional[bytes] = ..., mtp_hidden_shape: _Optional[_Iterable[int]] = ..., mtp_hidden_dtype: _Optional[str] = ...) -> None: ...

class KVPage(_message.Message):
    __slots__ = ("request_id", "kind", "layer", "token_start", "token_end", "page_size", "dtype", "k_shape", "v_shape", "k", "v", "checksum")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    K_SHAPE_FIELD_NUMBER: _ClassVar[int]
    V_SHAPE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: str
    layer: int
    token_start: int
    token_end: int
    page_size: int
    dtype: str
    k_shape: _containers.RepeatedScalarFieldContainer[int]
    v_shape: _containers.RepeatedScalarFieldContainer[int]
    k: bytes
    v: bytes
    checksum: int
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[str] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., k_shape: _Optional[_Iterable[int]] = ..., v_shape: _Optional[_Iterable[int]] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class TransferMessage(_message.Message):
    __slots__ = ("header", "page")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    page: KVPage
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., page: _Optional[_Union[KVPage, _Mapping]] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("request_id", "bytes_received", "pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    bytes_received: int
    pages: int
    def __init__(self, request_id: _Optional[str] = ..., bytes_received: _Optional[int] = ..., pages: _Optional[int] = ...) -> None: ...

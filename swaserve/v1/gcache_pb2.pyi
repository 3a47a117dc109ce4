from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageRef(_message.Message):
    __slots__ = ("key", "kind")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    kind: int
    def __init__(self, key: _Optional[bytes] = ..., kind: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pages", "lease_s")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[PageRef]
    lease_s: float
    def __init__(self, pages: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("present", "lease")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    lease: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., lease: _Optional[int] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("page", "parent", "index", "size", "parent_elsewhere", "has_block", "block", "block_depth", "has_block_parent", "block_parent")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PARENT_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    HAS_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HAS_BLOCK_PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_PARENT_FIELD_NUMBER: _ClassVar[int]
    page: PageRef
    parent: bytes
    index: int
    size: int
    parent_elsewhere: bool
    has_block: bool
    block: int
    block_depth: int
    has_block_parent: bool
    block_parent: int
    def __init__(self, page: _Optional[_Union[PageRef, _Mapping]] = ..., parent: _Optional[bytes] = ..., index: _Optional[int] = ..., size: _Optional[int] = ..., parent_elsewhere: _Optional[bool] = ..., has_block: _Optional[bool] = ..., block: _Optional[int] = ..., block_depth: _Optional[int] = ..., has_block_parent: _Optional[bool] = ..., block_parent: _Optional[int] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ...) -> None: ...

class PutSlot(_message.Message):
    __slots__ = ("status", "reservation")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESERVED: _ClassVar[PutSlot.Status]
        EXISTS: _ClassVar[PutSlot.Status]
        BUSY: _ClassVar[PutSlot.Status]
        FULL: _ClassVar[PutSlot.Status]
        NO_PARENT: _ClassVar[PutSlot.Status]
    RESERVED: PutSlot.Status
    EXISTS: PutSlot.Status
    BUSY: PutSlot.Status
    FULL: PutSlot.Status
    NO_PARENT: PutSlot.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    status: PutSlot.Status
    reservation: int
    def __init__(self, status: _Optional[_Union[PutSlot.Status, str]] = ..., reservation: _Optional[int] = ...) -> None: ...

class PutStartReply(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[PutSlot]
    def __init__(self, slots: _Optional[_Iterable[_Union[PutSlot, _Mapping]]] = ...) -> None: ...

class PutDataRequest(_message.Message):
    __slots__ = ("reservations",)
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservations: _Optional[_Iterable[int]] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("reservation", "object")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    reservation: int
    object: bytes
    def __init__(self, reservation: _Optional[int] = ..., object: _Optional[bytes] = ...) -> None: ...

class PutDataReply(_message.Message):
    __slots__ = ("committed", "errors")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    committed: _containers.RepeatedScalarFieldContainer[bool]
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, committed: _Optional[_Iterable[bool]] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("pages", "lease")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[PageRef]
    lease: int
    def __init__(self, pages: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., lease: _Optional[int] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, found: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("i", "object")
    I_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    i: int
    object: bytes
    def __init__(self, i: _Optional[int] = ..., object: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: int
    def __init__(self, lease: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[PageRef]
    def __init__(self, pages: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "capacity", "used", "pages", "leased")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity: int
    used: int
    pages: int
    leased: int
    def __init__(self, tier: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., pages: _Optional[int] = ..., leased: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("node_id", "ucx_port", "tiers", "draining", "direct_io")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UCX_PORT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    ucx_port: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    draining: bool
    direct_io: bool
    def __init__(self, node_id: _Optional[str] = ..., ucx_port: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., draining: _Optional[bool] = ..., direct_io: _Optional[bool] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

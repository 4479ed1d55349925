"""Kafka error codes (protocol guide, "Error Codes") and how sbpstream errors map to them."""

from __future__ import annotations

from typing import Final

from sbpstream.protocol.errors import ClientErrorCode, ErrorCode, SbpError

NONE: Final = 0
UNKNOWN_SERVER_ERROR: Final = -1
OFFSET_OUT_OF_RANGE: Final = 1
CORRUPT_MESSAGE: Final = 2
UNKNOWN_TOPIC_OR_PARTITION: Final = 3
LEADER_NOT_AVAILABLE: Final = 5
NOT_LEADER_OR_FOLLOWER: Final = 6
REQUEST_TIMED_OUT: Final = 7
MESSAGE_TOO_LARGE: Final = 10
COORDINATOR_NOT_AVAILABLE: Final = 15
NOT_COORDINATOR: Final = 16
INVALID_TOPIC_EXCEPTION: Final = 17
NOT_ENOUGH_REPLICAS: Final = 19
INVALID_REQUIRED_ACKS: Final = 21
ILLEGAL_GENERATION: Final = 22
INCONSISTENT_GROUP_PROTOCOL: Final = 23
INVALID_GROUP_ID: Final = 24
UNKNOWN_MEMBER_ID: Final = 25
INVALID_SESSION_TIMEOUT: Final = 26
REBALANCE_IN_PROGRESS: Final = 27
UNSUPPORTED_VERSION: Final = 35
TOPIC_ALREADY_EXISTS: Final = 36
INVALID_PARTITIONS: Final = 37
INVALID_REPLICATION_FACTOR: Final = 38
INVALID_CONFIG: Final = 40
INVALID_REQUEST: Final = 42
UNSUPPORTED_FOR_MESSAGE_FORMAT: Final = 43
OUT_OF_ORDER_SEQUENCE_NUMBER: Final = 45
INVALID_PRODUCER_EPOCH: Final = 47
TOPIC_AUTHORIZATION_FAILED: Final = 29
GROUP_AUTHORIZATION_FAILED: Final = 30
CLUSTER_AUTHORIZATION_FAILED: Final = 31
UNSUPPORTED_SASL_MECHANISM: Final = 33
ILLEGAL_SASL_STATE: Final = 34
KAFKA_STORAGE_ERROR: Final = 56
SASL_AUTHENTICATION_FAILED: Final = 58
UNKNOWN_PRODUCER_ID: Final = 59
NON_EMPTY_GROUP: Final = 68
GROUP_ID_NOT_FOUND: Final = 69
UNSUPPORTED_COMPRESSION_TYPE: Final = 76
GROUP_MAX_SIZE_REACHED: Final = 81

_MAP: Final[dict[int, int]] = {
    ErrorCode.STREAM_NOT_FOUND: UNKNOWN_TOPIC_OR_PARTITION,
    ErrorCode.STREAM_DELETED: UNKNOWN_TOPIC_OR_PARTITION,
    ErrorCode.OFFSET_OUT_OF_RANGE: OFFSET_OUT_OF_RANGE,
    ErrorCode.OFFSET_TRIMMED: OFFSET_OUT_OF_RANGE,
    ErrorCode.CORRUPT_BATCH: CORRUPT_MESSAGE,
    ErrorCode.CHECKSUM_MISMATCH: CORRUPT_MESSAGE,
    ErrorCode.OUT_OF_ORDER_SEQUENCE: OUT_OF_ORDER_SEQUENCE_NUMBER,
    ErrorCode.PRODUCER_FENCED: INVALID_PRODUCER_EPOCH,
    ErrorCode.REPLICA_UNAVAILABLE: NOT_ENOUGH_REPLICAS,
    ErrorCode.NOT_ENOUGH_DATA_NODES: NOT_ENOUGH_REPLICAS,
    ErrorCode.RANGE_SEALED: NOT_LEADER_OR_FOLLOWER,
    ErrorCode.NOT_PRIMARY: NOT_LEADER_OR_FOLLOWER,
    ErrorCode.RANGE_NOT_FOUND: NOT_LEADER_OR_FOLLOWER,
    ErrorCode.TIMEOUT: REQUEST_TIMED_OUT,
    ErrorCode.TOO_MANY_REQUESTS: REQUEST_TIMED_OUT,
    ErrorCode.THROTTLED: REQUEST_TIMED_OUT,
    ErrorCode.SHUTTING_DOWN: LEADER_NOT_AVAILABLE,
    ErrorCode.PM_NOT_LEADER: LEADER_NOT_AVAILABLE,
    ErrorCode.STORAGE_FULL: KAFKA_STORAGE_ERROR,
    ErrorCode.STORAGE_ERROR: KAFKA_STORAGE_ERROR,
    ErrorCode.LIMIT_EXCEEDED: MESSAGE_TOO_LARGE,
    ErrorCode.INVALID_STREAM_CONFIG: INVALID_CONFIG,
    ErrorCode.INVALID_REQUEST: INVALID_REQUEST,
    # a commit from the gateway while sbpstream consumers are live members of the group
    ErrorCode.GROUP_NOT_EMPTY: INCONSISTENT_GROUP_PROTOCOL,
    ErrorCode.UNKNOWN_MEMBER: UNKNOWN_MEMBER_ID,
    ErrorCode.ILLEGAL_GENERATION: ILLEGAL_GENERATION,
    # auth: a refusal by the ACLs of the connection's principal is about the resource served
    # (a topic by default: group and cluster requests map it with group_code/cluster_code);
    # the cluster asking for a login means the connection has none that is valid
    ErrorCode.AUTHORIZATION_FAILED: TOPIC_AUTHORIZATION_FAILED,
    ErrorCode.AUTHENTICATION_REQUIRED: SASL_AUTHENTICATION_FAILED,
    ErrorCode.AUTHENTICATION_FAILED: SASL_AUTHENTICATION_FAILED,
    ErrorCode.TOKEN_EXPIRED: SASL_AUTHENTICATION_FAILED,
    # the client's own: the request's fate is unknown, so a timeout (the producer retries and
    # the gateway's sequence check drops what was stored)
    ClientErrorCode.CONNECTION_CLOSED: REQUEST_TIMED_OUT,
    ClientErrorCode.CLIENT_TIMEOUT: REQUEST_TIMED_OUT,
    ClientErrorCode.NO_PM_REACHABLE: LEADER_NOT_AVAILABLE,
}


def kafka_code(exc: BaseException) -> int:
    """The Kafka error code for an exception raised while serving a partition."""
    if isinstance(exc, SbpError):
        return _MAP.get(int(exc.code), UNKNOWN_SERVER_ERROR)
    if isinstance(exc, TimeoutError):
        return REQUEST_TIMED_OUT
    return UNKNOWN_SERVER_ERROR


def group_code(exc: BaseException) -> int:
    """:func:`kafka_code` for a request about a consumer group: a refusal is the group's."""
    code = kafka_code(exc)
    return GROUP_AUTHORIZATION_FAILED if code == TOPIC_AUTHORIZATION_FAILED else code


def cluster_code(exc: BaseException) -> int:
    """:func:`kafka_code` for a request about the cluster: a refusal is the cluster's."""
    code = kafka_code(exc)
    return CLUSTER_AUTHORIZATION_FAILED if code == TOPIC_AUTHORIZATION_FAILED else code

"""The Kafka messages the gateway serves, transcribed from Kafka's message JSON schemas
(``clients/src/main/resources/common/message/<Name>{Request,Response}.json``) for the versions
served (:data:`SUPPORTED`). Tagged fields are left out: all are ignorable. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sbpstream.kafka.codec import F, Schema

# api keys
PRODUCE: Final = 0
FETCH: Final = 1
LIST_OFFSETS: Final = 2
METADATA: Final = 3
OFFSET_COMMIT: Final = 8
OFFSET_FETCH: Final = 9
FIND_COORDINATOR: Final = 10
JOIN_GROUP: Final = 11
HEARTBEAT: Final = 12
LEAVE_GROUP: Final = 13
SYNC_GROUP: Final = 14
DESCRIBE_GROUPS: Final = 15
LIST_GROUPS: Final = 16
SASL_HANDSHAKE: Final = 17
API_VERSIONS: Final = 18
CREATE_TOPICS: Final = 19
DELETE_TOPICS: Final = 20
INIT_PRODUCER_ID: Final = 22
SASL_AUTHENTICATE: Final = 36


@dataclass(frozen=True, slots=True)
class Api:
    key: int
    name: str
    min_version: int
    max_version: int
    request: Schema
    response: Schema


def _s(name: str, flexible: int, *fields: F) -> Schema:
    return Schema(name, fields, flexible)


API_VERSIONS_REQ = _s("ApiVersionsRequest", 3,
    F("client_software_name", "string", "3+"),
    F("client_software_version", "string", "3+"),
)
API_VERSIONS_RESP = _s("ApiVersionsResponse", 3,
    F("error_code", "int16"),
    F("api_keys", "[]", fields=(
        F("api_key", "int16"), F("min_version", "int16"), F("max_version", "int16"))),
    F("throttle_time_ms", "int32", "1+"),
)

METADATA_REQ = _s("MetadataRequest", 9,
    F("topics", "[]", nullable="1+", fields=(F("name", "string"),)),
    F("allow_auto_topic_creation", "bool", "4+", default=True),
    F("include_cluster_authorized_operations", "bool", "8-10"),
    F("include_topic_authorized_operations", "bool", "8+"),
)
METADATA_RESP = _s("MetadataResponse", 9,
    F("throttle_time_ms", "int32", "3+"),
    F("brokers", "[]", fields=(
        F("node_id", "int32"), F("host", "string"), F("port", "int32"),
        F("rack", "string", "1+", nullable="1+"))),
    F("cluster_id", "string", "2+", nullable="2+"),
    F("controller_id", "int32", "1+", default=-1),
    F("topics", "[]", fields=(
        F("error_code", "int16"),
        F("name", "string"),
        F("is_internal", "bool", "1+"),
        F("partitions", "[]", fields=(
            F("error_code", "int16"),
            F("partition_index", "int32"),
            F("leader_id", "int32"),
            F("leader_epoch", "int32", "7+", default=-1),
            F("replica_nodes", "[]int32"),
            F("isr_nodes", "[]int32"),
            F("offline_replicas", "[]int32", "5+"))),
        F("topic_authorized_operations", "int32", "8+", default=-2147483648))),
    F("cluster_authorized_operations", "int32", "8-10", default=-2147483648),
)

PRODUCE_REQ = _s("ProduceRequest", 9,
    F("transactional_id", "string", "3+", nullable="3+"),
    F("acks", "int16"),
    F("timeout_ms", "int32"),
    F("topic_data", "[]", fields=(
        F("name", "string"),
        F("partition_data", "[]", fields=(F("index", "int32"), F("records", "records"))))),
)
PRODUCE_RESP = _s("ProduceResponse", 9,
    F("responses", "[]", fields=(
        F("name", "string"),
        F("partition_responses", "[]", fields=(
            F("index", "int32"),
            F("error_code", "int16"),
            F("base_offset", "int64"),
            F("log_append_time_ms", "int64", "2+", default=-1),
            F("log_start_offset", "int64", "5+", default=-1),
            F("record_errors", "[]", "8+", fields=(
                F("batch_index", "int32"),
                F("batch_index_error_message", "string", nullable="8+"))),
            F("error_message", "string", "8+", nullable="8+"))))),
    F("throttle_time_ms", "int32", "1+"),
)

FETCH_REQ = _s("FetchRequest", 12,
    F("replica_id", "int32", "0-14", default=-1),
    F("max_wait_ms", "int32"),
    F("min_bytes", "int32"),
    F("max_bytes", "int32", "3+", default=0x7FFFFFFF),
    F("isolation_level", "int8", "4+"),
    F("session_id", "int32", "7+"),
    F("session_epoch", "int32", "7+", default=-1),
    F("topics", "[]", fields=(
        F("topic", "string", "0-12"),
        F("partitions", "[]", fields=(
            F("partition", "int32"),
            F("current_leader_epoch", "int32", "9+", default=-1),
            F("fetch_offset", "int64"),
            F("last_fetched_epoch", "int32", "12+", default=-1),
            F("log_start_offset", "int64", "5+", default=-1),
            F("partition_max_bytes", "int32"))))),
    F("forgotten_topics_data", "[]", "7+", fields=(
        F("topic", "string", "7-12"), F("partitions", "[]int32", "7+"))),
    F("rack_id", "string", "11+"),
)
FETCH_RESP = _s("FetchResponse", 12,
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "7+"),
    F("session_id", "int32", "7+"),
    F("responses", "[]", fields=(
        F("topic", "string", "0-12"),
        F("partitions", "[]", fields=(
            F("partition_index", "int32"),
            F("error_code", "int16"),
            F("high_watermark", "int64"),
            F("last_stable_offset", "int64", "4+", default=-1),
            F("log_start_offset", "int64", "5+", default=-1),
            F("aborted_transactions", "[]", "4+", nullable="4+", fields=(
                F("producer_id", "int64"), F("first_offset", "int64"))),
            F("preferred_read_replica", "int32", "11+", default=-1),
            F("records", "records", nullable="0+"))))),
)

LIST_OFFSETS_REQ = _s("ListOffsetsRequest", 6,
    F("replica_id", "int32"),
    F("isolation_level", "int8", "2+"),
    F("topics", "[]", fields=(
        F("name", "string"),
        F("partitions", "[]", fields=(
            F("partition_index", "int32"),
            F("current_leader_epoch", "int32", "4+", default=-1),
            F("timestamp", "int64"),
            F("max_num_offsets", "int32", "0", default=1))))),
    F("timeout_ms", "int32", "10+"),
)
LIST_OFFSETS_RESP = _s("ListOffsetsResponse", 6,
    F("throttle_time_ms", "int32", "2+"),
    F("topics", "[]", fields=(
        F("name", "string"),
        F("partitions", "[]", fields=(
            F("partition_index", "int32"),
            F("error_code", "int16"),
            F("old_style_offsets", "[]int64", "0"),
            F("timestamp", "int64", "1+", default=-1),
            F("offset", "int64", "1+", default=-1),
            F("leader_epoch", "int32", "4+", default=-1))))),
)

CREATE_TOPICS_REQ = _s("CreateTopicsRequest", 5,
    F("topics", "[]", fields=(
        F("name", "string"),
        F("num_partitions", "int32"),
        F("replication_factor", "int16"),
        F("assignments", "[]", fields=(
            F("partition_index", "int32"), F("broker_ids", "[]int32"))),
        F("configs", "[]", fields=(
            F("name", "string"), F("value", "string", nullable="0+"))))),
    F("timeout_ms", "int32", default=60000),
    F("validate_only", "bool", "1+"),
)
CREATE_TOPICS_RESP = _s("CreateTopicsResponse", 5,
    F("throttle_time_ms", "int32", "2+"),
    F("topics", "[]", fields=(
        F("name", "string"),
        F("topic_id", "uuid", "7+"),
        F("error_code", "int16"),
        F("error_message", "string", "1+", nullable="0+"),
        F("num_partitions", "int32", "5+", default=-1),
        F("replication_factor", "int16", "5+", default=-1),
        F("configs", "[]", "5+", nullable="5+", fields=(
            F("name", "string"), F("value", "string", nullable="5+"),
            F("read_only", "bool"), F("config_source", "int8", default=-1),
            F("is_sensitive", "bool"))))),
)

DELETE_TOPICS_REQ = _s("DeleteTopicsRequest", 4,
    F("topics", "[]", "6+", fields=(
        F("name", "string", nullable="6+"), F("topic_id", "uuid"))),
    F("topic_names", "[]string", "0-5"),
    F("timeout_ms", "int32"),
)
DELETE_TOPICS_RESP = _s("DeleteTopicsResponse", 4,
    F("throttle_time_ms", "int32", "1+"),
    F("responses", "[]", fields=(
        F("name", "string", nullable="6+"),
        F("topic_id", "uuid", "6+"),
        F("error_code", "int16"),
        F("error_message", "string", "5+", nullable="5+"))),
)

INIT_PRODUCER_ID_REQ = _s("InitProducerIdRequest", 2,
    F("transactional_id", "string", nullable="0+"),
    F("transaction_timeout_ms", "int32"),
    F("producer_id", "int64", "3+", default=-1),
    F("producer_epoch", "int16", "3+", default=-1),
)
INIT_PRODUCER_ID_RESP = _s("InitProducerIdResponse", 2,
    F("throttle_time_ms", "int32"),
    F("error_code", "int16"),
    F("producer_id", "int64", default=-1),
    F("producer_epoch", "int16"),
)

OFFSET_COMMIT_REQ = _s("OffsetCommitRequest", 8,
    F("group_id", "string"),
    F("generation_id", "int32", "1+", default=-1),
    F("member_id", "string", "1+"),
    F("group_instance_id", "string", "7+", nullable="7+"),
    F("retention_time_ms", "int64", "2-4", default=-1),
    F("topics", "[]", fields=(
        F("name", "string"),
        F("partitions", "[]", fields=(
            F("partition_index", "int32"),
            F("committed_offset", "int64"),
            F("committed_leader_epoch", "int32", "6+", default=-1),
            F("commit_timestamp", "int64", "1", default=-1),
            F("committed_metadata", "string", nullable="0+"))))),
)
OFFSET_COMMIT_RESP = _s("OffsetCommitResponse", 8,
    F("throttle_time_ms", "int32", "3+"),
    F("topics", "[]", fields=(
        F("name", "string"),
        F("partitions", "[]", fields=(
            F("partition_index", "int32"), F("error_code", "int16"))))),
)

OFFSET_FETCH_REQ = _s("OffsetFetchRequest", 6,
    F("group_id", "string", "0-7"),
    F("topics", "[]", "0-7", nullable="2-7", fields=(
        F("name", "string"), F("partition_indexes", "[]int32"))),
    F("require_stable", "bool", "7+"),
)
OFFSET_FETCH_RESP = _s("OffsetFetchResponse", 6,
    F("throttle_time_ms", "int32", "3+"),
    F("topics", "[]", "0-7", fields=(
        F("name", "string"),
        F("partitions", "[]", fields=(
            F("partition_index", "int32"),
            F("committed_offset", "int64"),
            F("committed_leader_epoch", "int32", "5-7", default=-1),
            F("metadata", "string", nullable="0-7"),
            F("error_code", "int16"))))),
    F("error_code", "int16", "2-7"),
)

FIND_COORDINATOR_REQ = _s("FindCoordinatorRequest", 3,
    F("key", "string", "0-3"),
    F("key_type", "int8", "1+"),
)
FIND_COORDINATOR_RESP = _s("FindCoordinatorResponse", 3,
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16", "0-3"),
    F("error_message", "string", "1-3", nullable="1-3"),
    F("node_id", "int32", "0-3"),
    F("host", "string", "0-3"),
    F("port", "int32", "0-3"),
)

JOIN_GROUP_REQ = _s("JoinGroupRequest", 6,
    F("group_id", "string"),
    F("session_timeout_ms", "int32"),
    F("rebalance_timeout_ms", "int32", "1+", default=-1),
    F("member_id", "string"),
    F("group_instance_id", "string", "5+", nullable="5+"),
    F("protocol_type", "string"),
    F("protocols", "[]", fields=(F("name", "string"), F("metadata", "bytes"))),
)
JOIN_GROUP_RESP = _s("JoinGroupResponse", 6,
    F("throttle_time_ms", "int32", "2+"),
    F("error_code", "int16"),
    F("generation_id", "int32", default=-1),
    F("protocol_name", "string", nullable="7+"),
    F("leader", "string"),
    F("member_id", "string"),
    F("members", "[]", fields=(
        F("member_id", "string"),
        F("group_instance_id", "string", "5+", nullable="5+"),
        F("metadata", "bytes"))),
)

SYNC_GROUP_REQ = _s("SyncGroupRequest", 4,
    F("group_id", "string"),
    F("generation_id", "int32"),
    F("member_id", "string"),
    F("group_instance_id", "string", "3+", nullable="3+"),
    F("assignments", "[]", fields=(F("member_id", "string"), F("assignment", "bytes"))),
)
SYNC_GROUP_RESP = _s("SyncGroupResponse", 4,
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16"),
    F("assignment", "bytes"),
)

HEARTBEAT_REQ = _s("HeartbeatRequest", 4,
    F("group_id", "string"),
    F("generation_id", "int32"),
    F("member_id", "string"),
    F("group_instance_id", "string", "3+", nullable="3+"),
)
HEARTBEAT_RESP = _s("HeartbeatResponse", 4,
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16"),
)

LEAVE_GROUP_REQ = _s("LeaveGroupRequest", 4,
    F("group_id", "string"),
    F("member_id", "string", "0-2"),
    F("members", "[]", "3+", fields=(
        F("member_id", "string"), F("group_instance_id", "string", nullable="3+"))),
)
LEAVE_GROUP_RESP = _s("LeaveGroupResponse", 4,
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16"),
    F("members", "[]", "3+", fields=(
        F("member_id", "string"), F("group_instance_id", "string", nullable="3+"),
        F("error_code", "int16"))),
)

LIST_GROUPS_REQ = _s("ListGroupsRequest", 3,
    F("states_filter", "[]string", "4+"),
)
LIST_GROUPS_RESP = _s("ListGroupsResponse", 3,
    F("throttle_time_ms", "int32", "1+"),
    F("error_code", "int16"),
    F("groups", "[]", fields=(F("group_id", "string"), F("protocol_type", "string"))),
)

DESCRIBE_GROUPS_REQ = _s("DescribeGroupsRequest", 5,
    F("groups", "[]string"),
    F("include_authorized_operations", "bool", "3+"),
)
DESCRIBE_GROUPS_RESP = _s("DescribeGroupsResponse", 5,
    F("throttle_time_ms", "int32", "1+"),
    F("groups", "[]", fields=(
        F("error_code", "int16"),
        F("group_id", "string"),
        F("group_state", "string"),
        F("protocol_type", "string"),
        F("protocol_data", "string"),
        F("members", "[]", fields=(
            F("member_id", "string"),
            F("group_instance_id", "string", "4+", nullable="4+"),
            F("client_id", "string"),
            F("client_host", "string"),
            F("member_metadata", "bytes"),
            F("member_assignment", "bytes"))),
        F("authorized_operations", "int32", "3+", default=-2147483648))),
)

SASL_HANDSHAKE_REQ = _s("SaslHandshakeRequest", 32767,
    F("mechanism", "string"),
)
SASL_HANDSHAKE_RESP = _s("SaslHandshakeResponse", 32767,
    F("error_code", "int16"),
    F("mechanisms", "[]string"),
)

SASL_AUTHENTICATE_REQ = _s("SaslAuthenticateRequest", 2,
    F("auth_bytes", "bytes"),
)
SASL_AUTHENTICATE_RESP = _s("SaslAuthenticateResponse", 2,
    F("error_code", "int16"),
    F("error_message", "string", nullable="0+"),
    F("auth_bytes", "bytes"),
    F("session_lifetime_ms", "int64", "1+"),
)

# The versions served: those of a Kafka 2.4 broker (well trodden by librdkafka and
# kafka-python), from the first version that carries record batch v2 where records travel.
SUPPORTED: Final[dict[int, Api]] = {a.key: a for a in (
    Api(PRODUCE, "Produce", 3, 8, PRODUCE_REQ, PRODUCE_RESP),
    Api(FETCH, "Fetch", 4, 11, FETCH_REQ, FETCH_RESP),
    Api(LIST_OFFSETS, "ListOffsets", 1, 5, LIST_OFFSETS_REQ, LIST_OFFSETS_RESP),
    Api(METADATA, "Metadata", 0, 9, METADATA_REQ, METADATA_RESP),
    Api(API_VERSIONS, "ApiVersions", 0, 3, API_VERSIONS_REQ, API_VERSIONS_RESP),
    Api(CREATE_TOPICS, "CreateTopics", 0, 5, CREATE_TOPICS_REQ, CREATE_TOPICS_RESP),
    Api(DELETE_TOPICS, "DeleteTopics", 0, 4, DELETE_TOPICS_REQ, DELETE_TOPICS_RESP),
    Api(INIT_PRODUCER_ID, "InitProducerId", 0, 2, INIT_PRODUCER_ID_REQ, INIT_PRODUCER_ID_RESP),
    # consumer groups; OffsetCommit from v2 and OffsetFetch from v1 (the first versions whose
    # offsets Kafka keeps itself rather than in ZooKeeper)
    Api(OFFSET_COMMIT, "OffsetCommit", 2, 8, OFFSET_COMMIT_REQ, OFFSET_COMMIT_RESP),
    Api(OFFSET_FETCH, "OffsetFetch", 1, 6, OFFSET_FETCH_REQ, OFFSET_FETCH_RESP),
    Api(FIND_COORDINATOR, "FindCoordinator", 0, 3, FIND_COORDINATOR_REQ, FIND_COORDINATOR_RESP),
    Api(JOIN_GROUP, "JoinGroup", 0, 6, JOIN_GROUP_REQ, JOIN_GROUP_RESP),
    Api(HEARTBEAT, "Heartbeat", 0, 4, HEARTBEAT_REQ, HEARTBEAT_RESP),
    Api(LEAVE_GROUP, "LeaveGroup", 0, 4, LEAVE_GROUP_REQ, LEAVE_GROUP_RESP),
    Api(SYNC_GROUP, "SyncGroup", 0, 4, SYNC_GROUP_REQ, SYNC_GROUP_RESP),
    Api(DESCRIBE_GROUPS, "DescribeGroups", 0, 5, DESCRIBE_GROUPS_REQ, DESCRIBE_GROUPS_RESP),
    Api(LIST_GROUPS, "ListGroups", 0, 3, LIST_GROUPS_REQ, LIST_GROUPS_RESP),
    # SASL (KIP-43, KIP-152): v0 of the handshake is followed by raw SASL tokens, v1 by
    # SaslAuthenticate requests
    Api(SASL_HANDSHAKE, "SaslHandshake", 0, 1, SASL_HANDSHAKE_REQ, SASL_HANDSHAKE_RESP),
    Api(SASL_AUTHENTICATE, "SaslAuthenticate", 0, 2, SASL_AUTHENTICATE_REQ,
        SASL_AUTHENTICATE_RESP),
)}

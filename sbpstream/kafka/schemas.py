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
API_VERSIONS: Final = 18
CREATE_TOPICS: Final = 19
DELETE_TOPICS: Final = 20
INIT_PRODUCER_ID: Final = 22


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
)}

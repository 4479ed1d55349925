"""Sample messages shared by the message tests: one per message class, every field non-default.

The golden bytes (tests/data/golden_messages.txt) are pinned from these values: change a sample and
its golden line no longer matches. Add new samples rather than editing old ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flatbuffers

from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import ErrorCode

# ----------------------------------------------------------------- samples: every field non-default

NODE = m.DataNode(7, "dn-7.example:12379")
NODE2 = m.DataNode(8, "[::1]:12380")
ERR = m.Status(int(ErrorCode.RANGE_SEALED), "sealed", b"\x00\x01detail")
ERR2 = m.Status(int(ErrorCode.PM_NOT_LEADER), "not leader", b"10.0.0.2:12378")
RANGE = m.Range(
    stream_id=42,
    range_index=3,
    start_offset=1_000,
    next_offset=1_500,
    end_offset=1_500,
    replica_nodes=(m.ReplicaNode(NODE, True), m.ReplicaNode(NODE2, True)),
)
RANGE2 = dataclasses.replace(RANGE, range_index=4, start_offset=1_500, next_offset=1_600)
STREAM = m.Stream(42, 3, 86_400_000, 1_000, "orders.eu-1")
PRODUCER = m.ProducerState(1 << 40, 3, 99, 1_400)
QUOTA_BEFORE_USER = m.Quota(1, "client-1", 1 << 20, 2 << 20, 500)
QUOTA = dataclasses.replace(QUOTA_BEFORE_USER, user="alice")  # a user+client-id quota

SAMPLES: list[m.Message] = [
    m.PingRequest(),
    m.PingResponse(),
    m.GoAway(int(ErrorCode.SHUTTING_DOWN), "maintenance", 12345),
    m.GoAwayResponse(ERR),
    m.HeartbeatRequest("client-1", m.ClientRole.DATA_NODE, NODE, (RANGE,)),
    m.HeartbeatResponse("client-1", m.ClientRole.CLIENT, NODE, ERR2),
    m.AllocateIdRequest(3_000, "host-a"),
    m.AllocateIdResponse(17, ERR),
    m.AppendRequest(
        5_000,
        (m.AppendItem(42, 1, 4096, 3), m.AppendItem(-(1 << 62), 2, 123, 0)),
        True,
        1_234,
        (1_000, -1),
    ),
    m.AppendResponse(
        10,
        ERR,
        (m.AppendResult(42, 1, 1_000, 1_700_000_000_000, ERR, 1_010),),
    ),
    m.FetchRequest(
        500,
        1_024,
        (m.FetchItem(42, 1, 1_000, 1 << 20, 2), m.FetchItem(43, 2, 0, 65_536, 0)),
        9,
        4,
        (44, 45, -1),
        1 << 24,
    ),
    m.FetchResponse(
        20,
        ERR,
        (
            m.FetchResult(42, 1, 4096, ERR, 100, 2_000, 1_500),
            m.FetchResult(43, 7, 0, ERR2, 0, 1, 2),
        ),
        77,
    ),
    m.BufferAckRequest(1 << 33, 7, True),
    m.BufferAckResponse(ERR),
    m.ListRangesRequest(1_000, (m.StreamOwner(42), NODE, m.StreamOwner(-5))),
    m.ListRangesResponse(1, ERR, (m.ListRangesResult(42, ERR, (RANGE, RANGE2)),)),
    m.SealRangesRequest(1_000, (m.SealItem(42, 3, 1_500), m.SealItem(43, 0, 0)), 17),
    m.SealRangesResponse(
        2, ERR, (m.SealResult(42, ERR, (RANGE, RANGE2), (PRODUCER, m.ProducerState(5, 0, 0, 0))),)
    ),
    m.SyncRangesRequest(1_000, (m.StreamRanges(42, (RANGE2,)),)),
    m.SyncRangesResponse(3, ERR, (m.SyncResult(42, ERR, (RANGE2,)),)),
    m.DescribeRangesRequest(1_000, (m.DescribeRangeItem(42, 4, 1_500, 1_000),)),
    m.DescribeRangesResponse(4, ERR, (m.DescribeRangeResult(42, ERR, RANGE, "0f" * 16, 1_000,
                                                            1_500),)),
    m.CreateStreamsRequest(
        1_000, (m.CreateStreamItem(3, 86_400_000, "orders.eu-1"), m.CreateStreamItem(1, 1))),
    m.CreateStreamsResponse(5, ERR, (m.CreateStreamResult(STREAM, 3, 86_400_000, ERR),)),
    m.DeleteStreamsRequest(1_000, (STREAM,)),
    m.DeleteStreamsResponse(6, ERR, (m.StreamResult(STREAM, ERR),)),
    m.UpdateStreamsRequest(1_000, (STREAM, m.Stream(43, 1, 5, 6, "s43"))),
    m.UpdateStreamsResponse(7, ERR, (m.StreamResult(STREAM, ERR),)),
    m.DescribeStreamsRequest(1_000, (42, 43, 1 << 50), 100, 41, "orders.eu-1", "orders."),
    m.DescribeStreamsResponse(8, ERR, (m.StreamResult(STREAM, ERR),), 43),
    m.TrimStreamsRequest(1_000, (m.TrimItem(42, 1_200),)),
    m.TrimStreamsResponse(9, ERR, (m.TrimResult(STREAM, ERR, RANGE),)),
    m.ReportMetricsRequest(NODE, *range(1, 18)),
    m.ReportMetricsResponse(NODE, ERR),
    m.InfoRequest(),
    m.InfoResponse(ERR, "datanode", "0.1.0", 86_400_123, 7),
    m.StatsRequest((42, 43, 1 << 50), 5),
    m.StatsResponse(ERR, 3),
    m.ConnectionsRequest(100),
    m.ConnectionsResponse(ERR, 12),
    m.WhoamiRequest(),
    m.WhoamiResponse(ERR, 1 << 33, "127.0.0.1:50000", "client-1", m.ClientRole.CLIENT),
    m.SetQuotasRequest(1_000, (QUOTA, m.Quota(0, "", -1, 1 << 30, -1))),
    m.SetQuotasResponse(11, ERR, (m.QuotaResult(QUOTA, ERR),)),
    m.DeleteQuotasRequest(1_000, (QUOTA,)),
    m.DeleteQuotasResponse(12, ERR, (m.QuotaResult(QUOTA, ERR2),)),
    m.DescribeQuotasRequest(1_000),
    m.DescribeQuotasResponse(13, ERR, (QUOTA, m.Quota(2, "42", 5, 6, 7))),
    m.QuotaCountersRequest(1_000),
    m.QuotaCountersResponse(14, ERR, (m.QuotaCounter("c/client-1/produce", -7, 4, 2),), 10_000, 3,
                            (QUOTA,)),
    m.AuthenticateRequest("SCRAM-SHA-256", b"n,,n=alice,r=abc"),
    m.AuthenticateResponse(ERR, b"r=abcdef,s=c2FsdA==,i=4096", "tok.sig", 1_700_000_060_000,
                           "alice", True),
    m.ManageUsersRequest(1, "alice", "secret"),
    m.ManageUsersResponse(ERR, (m.UserEntry("alice"), m.UserEntry("bob"))),
    m.ManageAclsRequest(1, m.AclEntry("alice", "append,fetch", "prefix:orders-"), "alice"),
    m.ManageAclsResponse(ERR, (m.AclEntry("bob", "describe", "stream:42"),)),
    # consumer groups and committed offsets (project opcodes 0x1040-0x1048)
    m.JoinGroupRequest(1_000, "billing", "m-1", (42, 43), (m.NameItem("orders.eu-1"),),
                       "orders.*", 10_000, "client-1"),
    m.JoinGroupResponse(ERR, "m-1", 7, (42, 43), 10_000),
    m.GroupHeartbeatRequest(1_000, "billing", "m-1", 7, (42,)),
    m.GroupHeartbeatResponse(ERR, 8, (42, 43), 1),
    m.LeaveGroupRequest(1_000, "billing", "m-1"),
    m.LeaveGroupResponse(ERR),
    m.OffsetCommitRequest(1_000, "billing", "m-1", 7,
                          (m.OffsetCommitItem(42, 1_200, "batch 9"),)),
    m.OffsetCommitResponse(ERR, (m.OffsetCommitResult(42, ERR),)),
    m.OffsetFetchRequest(1_000, "billing", (42, 43)),
    m.OffsetFetchResponse(ERR, (m.OffsetFetchResult(42, 1_200, "batch 9", 1 << 40, ERR),)),
    m.DescribeGroupsRequest(1_000, (m.NameItem("billing"),)),
    m.DescribeGroupsResponse(ERR, (m.GroupDescription(
        "billing", ERR, "stable", 7,
        (m.GroupMember("m-1", "client-1", "127.0.0.1:50000", (42, 43), (42,)),), 2),)),
    m.ListGroupsRequest(1_000),
    m.ListGroupsResponse(ERR, (m.NameItem("billing"),)),
    m.DeleteGroupRequest(1_000, (m.NameItem("billing"),)),
    m.DeleteGroupResponse(ERR, (m.GroupResult("billing", ERR),)),
    m.ResetOffsetsRequest(1_000, "billing", (m.OffsetCommitItem(42, 1_200, "batch 9"),)),
    m.ResetOffsetsResponse(ERR, (m.OffsetCommitResult(42, ERR),)),
    # draining a data node (project opcode 0x1050)
    m.DrainNodeRequest(1_000, 1, 7, "dn-7.example:12379"),
    m.DrainNodeResponse(ERR, (m.DrainState(7, "dn-7.example:12379", True, True, 12, 3),)),
]


def write_vectors(put: Callable[[Any, Sequence[Any]], int], before: str,
                  vectors: Sequence[Sequence[Any]]) -> bytes:
    """The buffer ``put`` (a fast path or the builder's way) writes ``vectors`` into, after a
    string ``before`` (to vary alignment); the fast-path tests compare the two byte for byte."""
    b = flatbuffers.Builder(16)  # small: the fast path must grow the buffer as the builder does
    if before:
        b.CreateString(before)
    last = 0
    for items in vectors:
        last = put(b, items)
    b.Finish(last)
    return bytes(b.Output())

"""PendingFrames: what an activation receiver's subscription may queue follows the transport's window and frames."""

from hearth.services.common.config import TransportSettings
from hearth.services.transport.frames import header_budget_bytes
from hearth.services.transport.limits import PendingFrames, pending_frames_per_window, receiver_settings


def test_a_receiver_queues_a_few_windows_of_frames_not_nats_pys_65536_messages():
    transport = TransportSettings(window_chunks=16, chunk_bytes=1 << 20)
    pending = receiver_settings(transport)["pending"]
    assert pending == PendingFrames.of(transport)
    limits = pending.subscription_limits(max_step_bytes=1 << 30, max_payload_bytes=8 << 20)
    assert limits["pending_msgs_limit"] == pending_frames_per_window * 16 < 65536
    assert limits["pending_bytes_limit"] == pending_frames_per_window * 16 * ((1 << 20) + header_budget_bytes) + 1


def test_frames_are_bounded_by_the_pipelines_largest_step_and_the_servers_max_payload():
    pending = PendingFrames(frames=10, frame_bytes=1 << 20)
    assert pending.subscription_limits(max_step_bytes=640, max_payload_bytes=8 << 20)["pending_bytes_limit"] == \
        10 * (640 + header_budget_bytes) + 1
    assert pending.subscription_limits(max_step_bytes=1 << 30, max_payload_bytes=64 * 1024)["pending_bytes_limit"] == \
        10 * 64 * 1024 + 1

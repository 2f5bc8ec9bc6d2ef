"""Activation transport of docs/design.md §6: frames over core NATS, the ack-window sender, the receiver, ack watching.

A hop i of pipeline P receives on ``hearth.act.P.i`` and acks on ``hearth.ack.P.i``; the orchestrator
is the source (it sends into hop 0) and the sink (its receiver is hop ``len(hops)``). A shard host::

    async with ActivationReceiver(nc, P, i) as inbound, AckWindowSender(nc, P, i + 1) as outbound:
        async for received in inbound:
            output = await asyncio.to_thread(run_layers, received.info, received.tensor)
            await outbound.send(received.info, output)   # same session and step, forwarded

The orchestrator sends with ``AckWindowSender(nc, P, 0)``, reads results with
``ActivationReceiver(nc, P, len(hops))`` and watches ``AckObserver(nc, P, sink_hop=len(hops))``.
"""

from services.transport.acks import AckObserver, StepProgress
from services.transport.errors import FrameError, TransportClosed, TransportError, TransportTimeout, WaitInterrupted
from services.transport.frames import EncodedStep, decode_frames, encode_step
from services.transport.headers import AckHeader, FrameHeader, FrameKind, StepInfo
from services.transport.limits import StepLimits, StepRefusal
from services.transport.frames import ReceivedStep
from services.transport.receiver import ActivationReceiver
from services.transport.sender import AckWindowSender, SentStep
from services.transport.stats import LatencySamples, LatencySummary, ReceiverStats, SenderStats
from services.transport.wire import WireDtype, wire_dtype_from_setting

__all__ = [
    "AckHeader",
    "AckObserver",
    "AckWindowSender",
    "ActivationReceiver",
    "EncodedStep",
    "FrameError",
    "FrameHeader",
    "FrameKind",
    "LatencySamples",
    "LatencySummary",
    "ReceivedStep",
    "ReceiverStats",
    "SenderStats",
    "SentStep",
    "StepInfo",
    "StepLimits",
    "StepProgress",
    "StepRefusal",
    "TransportClosed",
    "TransportError",
    "TransportTimeout",
    "WaitInterrupted",
    "WireDtype",
    "decode_frames",
    "encode_step",
    "wire_dtype_from_setting",
]

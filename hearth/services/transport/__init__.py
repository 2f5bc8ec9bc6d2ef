"""Activation transport of docs/design.md §6: frames over core NATS, the ack-window sender, the receiver, ack watching.

A hop i of pipeline P receives on ``hearth.act.<receiver node>.P.i`` and its sender reads the acks on
``hearth.ack.<sender node>.P.i`` (hearth/protocol/subjects.py: each subject carries the node that subscribes to it, so a
broker permission lets a host read only what is sent to it; processes outside a community share the node token
``local``). The orchestrator is the source (it sends into hop 0) and the sink (its receiver is hop ``len(hops)``).
A shard host on node N, its input sent by node U and its output going to node D::

    inbound = ActivationReceiver(nc, P, i, nodes=LinkNodes(sender=U, receiver=N))
    outbound = AckWindowSender(nc, P, i + 1, nodes=LinkNodes(sender=N, receiver=D))
    async with inbound, outbound:
        async for received in inbound:
            output = await on_compute_thread(run_layers, received.info, received.tensor)
            await outbound.send(received.info, output)   # same session and step, forwarded

The orchestrator sends with ``AckWindowSender(nc, P, 0, nodes=...)``, reads results with
``ActivationReceiver(nc, P, len(hops), nodes=...)`` and watches every hop's acks (``hearth.ack.*.P.*``) with
``AckObserver(nc, P, sink_hop=len(hops))``.
"""

from hearth.services.transport.acks import AckObserver, StepProgress
from hearth.services.transport.errors import (
    FrameError, TransportClosed, TransportError, TransportTimeout, WaitInterrupted,
)
from hearth.services.transport.frames import EncodedStep, decode_frames, encode_step
from hearth.services.transport.headers import AckHeader, FrameHeader, FrameKind, StepInfo
from hearth.services.transport.limits import StepLimits, StepRefusal, receiver_settings
from hearth.services.transport.frames import ReceivedStep
from hearth.services.transport.receiver import ActivationReceiver
from hearth.services.transport.sender import AckWindowSender, SentStep, WindowCheck
from hearth.services.transport.stats import LatencySamples, LatencySummary, ReceiverStats, SenderStats
from hearth.services.transport.wire import WireDtype, wire_dtype_from_setting

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
    "WindowCheck",
    "WireDtype",
    "decode_frames",
    "encode_step",
    "receiver_settings",
    "wire_dtype_from_setting",
]

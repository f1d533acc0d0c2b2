"""Moving blocks between host and device: bucket layout, host buckets (pinned, low-bit,
with their moments), device slots, streams, the block pipeline and its stream model."""

from distzo.offload.block_store import BlockStore, ResidentBlocks
from distzo.offload.bucket import BucketLayout, bind
from distzo.offload.device_slots import DeviceSlots
from distzo.offload.scheduler import BlockScheduler
from distzo.offload.streamed_blocks import Shard, StreamedBlocks
from distzo.offload.streams import Streams
from distzo.offload.timeline import Span, Timeline

__all__ = [
    "BlockScheduler",
    "BlockStore",
    "BucketLayout",
    "DeviceSlots",
    "ResidentBlocks",
    "Shard",
    "Span",
    "StreamedBlocks",
    "Streams",
    "Timeline",
    "bind",
]

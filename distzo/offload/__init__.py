"""Moving blocks between host and device: bucket layout, host buckets, device slots,
streams and the block pipeline."""

from distzo.offload.block_store import BlockStore, OffloadedBlocks, ResidentBlocks
from distzo.offload.bucket import BucketLayout, bind
from distzo.offload.device_slots import DeviceSlots
from distzo.offload.host_buckets import HostBuckets
from distzo.offload.scheduler import BlockScheduler
from distzo.offload.streams import Streams
from distzo.offload.timeline import Span, Timeline

__all__ = [
    "BlockScheduler",
    "BlockStore",
    "BucketLayout",
    "DeviceSlots",
    "HostBuckets",
    "OffloadedBlocks",
    "ResidentBlocks",
    "Span",
    "Streams",
    "Timeline",
    "bind",
]

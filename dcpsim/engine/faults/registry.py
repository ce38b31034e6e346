"""The fault catalogue by name: one instance of every fault, in the order of the bug classes
(docs/dcp-semantics.md section 8, then the write guard), and the P/D faults.

``--inject NAME`` looks a fault up here (``get_fault``, ``get_pd_fault``); ``selftest`` runs
every registered one where it applies. A new bug class is one new entry.
"""

from __future__ import annotations

from dcpsim.engine.faults.admission import AdmissionLimitPerRankRows
from dcpsim.engine.faults.attention import (
    AllEmptyRowsMergeNan,
    EmptyShardLseFinite,
    EmptyShardLseZero,
    EmptyShardNanUnguarded,
    GatheredHeadsGqaRemapped,
    LseBaseMismatch,
    MergeVariantPerRank,
    NonOwnerSkipsQueryRows,
)
from dcpsim.engine.faults.base import Fault
from dcpsim.engine.faults.draft import DraftDropsDcp, DraftIndptrFromGlobalLens
from dcpsim.engine.faults.gather import ContextGatherWholeLocalLen
from dcpsim.engine.faults.helix import HelixDecodeOwnerUnclamped
from dcpsim.engine.faults.helix_verify import HelixVerifyFixedDraftLen
from dcpsim.engine.faults.layout import (
    AdmissionCapacityUnscaled,
    ForeignBlock,
    InterleaveOffByOne,
    KernelVirtualBlock,
    MergeDropsDcpReplicated,
    ReplicatedOwnerOnly,
    ReplicatedScaledByW,
    RingRejectedOverwrite,
    SlidingWindowEarlyRelease,
)
from dcpsim.engine.faults.mamba import DcpTransformOnReplicated, MambaBlockSizeScaledByW
from dcpsim.engine.faults.metadata import (
    BlockTableWidthUnsharded,
    CudagraphPaddingWrites,
    CudagraphStaleLocalLens,
    GlobalSeqLensOverwritten,
    LocalLensPlusOne,
    MultiTokenLocalLens,
    PaddedSlotsNotReset,
    PageTableTranslatedTwice,
    PlanPagesFromGlobalLen,
    SpecMaskInterleaveOne,
    VerifyLocalLensMinusRejected,
    ZeroLocalRowsCompacted,
)
from dcpsim.engine.faults.pcp import (
    DcpRankNotTransposed,
    PcpChunksNotMirrored,
    PcpGatherRankLocal,
    PcpSlotsCutToLocalTokens,
    PcpSpecRegularMask,
    PcpTailKeysFromHeadChunk,
    PcpUniformDecodeSlots,
)
from dcpsim.engine.faults.pd import (
    NixlInterleaveNotBlockSize,
    NixlOneSourceRank,
    NixlPageTailNotCleared,
    NixlPullsOutsideIntersection,
    NixlSkipsEmptyRankNotice,
    NixlStrideByDcp,
    PDFault,
    PrefillFreesPerPull,
    ReshardIgnoresInterleave,
)
from dcpsim.engine.faults.prefix import (
    CompressedHitDropsR,
    EagleDropEveryGroup,
    EagleDropUnscaled,
    EagleMarginUnscaled,
    KvEventsHashUnitB,
    PartialHitStaleCow,
    PrefixHashUnitB,
    PrefixHitGcdAligned,
)
from dcpsim.engine.faults.retention import SlidingWindowReleaseOneEarly
from dcpsim.engine.faults.sparse import SparseRowMaskedByEmptyShard, TopkLocalInterleaveOne, TopkTieOrder
from dcpsim.errors import ConfigError

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(),
        PrefixHashUnitB(),
        KernelVirtualBlock(),
        MultiTokenLocalLens(),
        EmptyShardLseZero(),
        ReplicatedScaledByW(),
        MergeDropsDcpReplicated(),
        ReplicatedOwnerOnly(),
        SlidingWindowEarlyRelease(),
        RingRejectedOverwrite(),
        InterleaveOffByOne(),
        DraftDropsDcp(),
        PlanPagesFromGlobalLen(),
        GlobalSeqLensOverwritten(),
        LocalLensPlusOne(),
        BlockTableWidthUnsharded(),
        CudagraphPaddingWrites(),
        LseBaseMismatch(),
        EmptyShardNanUnguarded(),
        AdmissionCapacityUnscaled(),
        KvEventsHashUnitB(),
        DraftIndptrFromGlobalLens(),
        CompressedHitDropsR(),
        MambaBlockSizeScaledByW(),
        DcpTransformOnReplicated(),
        PcpGatherRankLocal(),
        PcpChunksNotMirrored(),
        DcpRankNotTransposed(),
        PcpSpecRegularMask(),
        PaddedSlotsNotReset(),
        CudagraphStaleLocalLens(),
        PcpSlotsCutToLocalTokens(),
        PcpUniformDecodeSlots(),
        PcpTailKeysFromHeadChunk(),
        PrefixHitGcdAligned(),
        TopkTieOrder(),
        SparseRowMaskedByEmptyShard(),
        ForeignBlock(),
        ContextGatherWholeLocalLen(),
        EmptyShardLseFinite(),
        AllEmptyRowsMergeNan(),
        MergeVariantPerRank(),
        SpecMaskInterleaveOne(),
        EagleMarginUnscaled(),
        EagleDropUnscaled(),
        VerifyLocalLensMinusRejected(),
        TopkLocalInterleaveOne(),
        PageTableTranslatedTwice(),
        SlidingWindowReleaseOneEarly(),
        ZeroLocalRowsCompacted(),
        EagleDropEveryGroup(),
        GatheredHeadsGqaRemapped(),
        NonOwnerSkipsQueryRows(),
        HelixDecodeOwnerUnclamped(),
        HelixVerifyFixedDraftLen(),
        AdmissionLimitPerRankRows(),
        PartialHitStaleCow(),
    )
}


def get_fault(name: str | None) -> Fault:
    if name is None:
        return FAULTS["none"]
    try:
        return FAULTS[name]
    except KeyError:
        raise ConfigError(f"--inject: unknown fault {name!r}; known: {', '.join(n for n in FAULTS if n != 'none')}") from None


PD_FAULTS: dict[str, PDFault] = {
    f.name: f
    for f in (
        PDFault(),
        NixlStrideByDcp(),
        NixlInterleaveNotBlockSize(),
        ReshardIgnoresInterleave(),
        NixlOneSourceRank(),
        NixlPullsOutsideIntersection(),
        PrefillFreesPerPull(),
        NixlSkipsEmptyRankNotice(),
        NixlPageTailNotCleared(),
    )
}


def get_pd_fault(name: str | None) -> PDFault:
    if name is None:
        return PD_FAULTS["none"]
    try:
        return PD_FAULTS[name]
    except KeyError:
        raise ConfigError(f"--inject: {name!r} is not a P/D fault; P/D faults: {', '.join(n for n in PD_FAULTS if n != 'none')}") from None

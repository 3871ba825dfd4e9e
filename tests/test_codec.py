"""KV codecs (``kvtier.codec``): round trips, sizes, bounds, hostile headers and the store's use of them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import KVLayout, TieredStore
from kvtier.codec import CODECS, CodecDataError, CodecRecord, Encoder, KVGeometry, decode_into, namespace_tag
from kvtier.config import load_settings
from kvtier.format import _CHECK, CODEC_RECORD_END, HEADER_STRUCT_BYTES, unpack_header

GEOMS = [KVGeometry(3, 2, 16, 64, torch.bfloat16, interleaved=True),
         KVGeometry(2, 1, 256, 64, torch.float16, interleaved=False),
         KVGeometry(1, 3, 8, 24, torch.float32, interleaved=True)]


def kv_like(geom: KVGeometry, seed: int = 0) -> torch.Tensor:
    """Keys with per-channel offsets and an outlier channel, values of varying scale per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(geom.elements, generator=g).view(geom.layers, -1, geom.row_elems)
    x = x + torch.randn(1, 1, geom.row_elems, generator=g) * 4
    x[..., 0] *= 40
    return x.reshape(-1).to(geom.dtype).view(torch.uint8).clone()


def round_trip(name: str, geom: KVGeometry, raw: torch.Tensor) -> tuple[torch.Tensor, int]:
    stored, record = Encoder(CODECS[name], geom).encode(raw)
    out = torch.empty_like(raw)
    decode_into(record, stored, out)
    return out.view(geom.dtype).float(), stored.numel()


@pytest.mark.parametrize("geom", GEOMS, ids=["bf16-interleaved", "fp16-split", "fp32-odd"])
def test_lossless_is_exact_and_lossy_codecs_stay_within_their_precision(geom: KVGeometry) -> None:
    raw = kv_like(geom)
    x = raw.view(geom.dtype).float()
    got, _ = round_trip("lossless", geom, raw)
    assert torch.equal(got.view(torch.int32) if geom.dtype == torch.float32 else got, x.view(torch.int32)
                       if geom.dtype == torch.float32 else x)
    k, v = (t.reshape(geom.layers, geom.tokens, geom.row_elems).float() for t in geom.split(raw))
    for name, k_tol, v_tol in (("fp8", 1 / 16, 1 / 16), ("k8v4", 1 / 250, 1 / 14), ("k8v8", 1 / 250, 1 / 250)):
        out = torch.empty_like(raw)
        stored, record = Encoder(CODECS[name], geom).encode(raw)
        decode_into(record, stored, out)
        ko, vo = (t.reshape(k.shape).float() for t in geom.split(out))
        # fp8: each element within half a unit of its 3-bit mantissa of the group's largest
        # magnitude; k8v4, k8v8: within one code step of the group's span.
        if name == "fp8":
            k_span, v_span = k.abs().amax(dim=1, keepdim=True), v.abs().amax(dim=2, keepdim=True)
        else:
            k_span = (k.amax(dim=1, keepdim=True) - k.amin(dim=1, keepdim=True))
            v_span = (v.amax(dim=2, keepdim=True) - v.amin(dim=2, keepdim=True))
        assert ((ko - k).abs() <= k_span * k_tol + 1e-2).all(), name
        assert ((vo - v).abs() <= v_span * v_tol + 1e-2).all(), name


@pytest.mark.parametrize("name,least", [("fp8", 1.9), ("k8v4", 2.5), ("k8v8", 1.9), ("fp8_cast", 2.0)])
def test_lossy_codecs_store_the_sizes_they_promise(name: str, least: float) -> None:
    geom = KVGeometry(30, 2, 128, 64, torch.bfloat16, interleaved=True)  # SmolLM2's head shard, 256 tokens
    _, stored = round_trip(name, geom, kv_like(geom))
    assert geom.raw_bytes / stored >= least


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["fp8", "k8v4", "k8v8"]), st.floats(1e-6, 1e6))
def test_any_finite_kv_decodes_to_finite_values_near_it(seed: int, name: str, scale: float) -> None:
    """Within 10% of the largest magnitude; k8v4 and k8v8 clamp what float16 cannot hold (|x| > 65504)."""
    geom = GEOMS[0]
    raw = (kv_like(geom, seed).view(geom.dtype).float() * scale).to(geom.dtype).view(torch.uint8)
    got, _ = round_trip(name, geom, raw)
    x = raw.view(geom.dtype).float()
    if name != "fp8":
        x = x.clamp(-65504, 65504)
    assert torch.isfinite(got).all()
    assert (got - x).abs().max() <= 0.1 * x.abs().max()


def test_keys_stored_channel_by_channel_are_found_recorded_and_coded_per_channel() -> None:
    """vLLM's CPU build stores a K page as [head_dim, block_size]: read as [tokens, channels], a
    "channel" would mix channels, and its scale and mean would miss each channel's offset."""
    geom = KVGeometry(2, 2, 128, 64, torch.bfloat16, interleaved=True)
    tokens_first = kv_like(geom)
    k, v = (t.clone() for t in geom.split(tokens_first))  # [layers, pages, rows, channels]
    raw = torch.empty_like(tokens_first)
    flipped = KVGeometry(2, 2, 128, 64, torch.bfloat16, interleaved=True, k_channels_first=True)
    flipped.join(raw, k.reshape(2, 256, 64), v.reshape(2, 256, 64))  # K pages as [channels, rows]
    assert geom.oriented(raw) == flipped and geom.oriented(tokens_first) == geom
    for name in ("fp8", "k8v4", "k8v8"):
        stored, record = Encoder(CODECS[name], geom).encode(raw)
        assert record.layout == flipped.layout_bits == 0b011
        out = torch.empty_like(raw)
        decode_into(record, stored, out)
        right = (flipped.split(out)[0].float() - k.float()).abs().mean().item()
        assert right < 0.04 * k.float().abs().mean().item(), name  # e4m3: about 2% of a value
        # The same bytes coded as if K were token by token: a uniform code's grouping costs
        # precision (fp8's e4m3 is relative: its scale only keeps a group in range).
        wrong = torch.empty_like(raw)
        decode_into(replace(record, layout=geom.layout_bits), CODECS[name].encode(raw, geom), wrong)
        assert torch.equal(wrong.view(geom.dtype).isfinite(), raw.view(geom.dtype).isfinite())
        if name != "fp8":
            assert (flipped.split(wrong)[0].float() - k.float()).abs().mean().item() > 2 * right, name


def test_a_layout_byte_with_unknown_bits_is_a_codec_error() -> None:
    geom = GEOMS[0]
    raw = kv_like(geom)
    stored, record = Encoder(CODECS["fp8"], geom).encode(raw)
    with pytest.raises(CodecDataError, match="layout"):
        decode_into(replace(record, layout=8), stored, torch.empty_like(raw))


def test_a_record_that_lies_about_its_geometry_is_a_codec_error_not_a_crash() -> None:
    geom = GEOMS[0]
    raw = kv_like(geom)
    stored, record = Encoder(CODECS["fp8"], geom).encode(raw)
    fields = record.__dict__
    for change in ({"k_group": 7}, {"v_group": 0}, {"layers": 4}, {"raw_bytes": record.raw_bytes + 2},
                   {"dtype_code": 99}, {"row_elems": 2**31 - 1}):
        bad = CodecRecord(**{**fields, **change})
        with pytest.raises(CodecDataError):
            decode_into(bad, stored, torch.empty_like(raw))
    with pytest.raises(CodecDataError):  # stored bytes of the wrong length
        decode_into(record, stored[:-1], torch.empty_like(raw))
    with pytest.raises(CodecDataError):  # zstd garbage
        _, lossless = Encoder(CODECS["lossless"], geom).encode(raw)
        decode_into(lossless, torch.zeros(100, dtype=torch.uint8), torch.empty_like(raw))


def test_lossy_codecs_have_a_namespace_of_their_own_and_lossless_shares_exact_kvs() -> None:
    layout = KVLayout(2, 1, 64)
    digests = {c: load_settings({"model_id": "m", "layout": layout, "kv_codec": c}).namespace().digest
               for c in ("none", "lossless", "fp8", "k8v4", "k8v8")}
    assert digests["none"] == digests["lossless"]
    assert len({digests["none"], digests["fp8"], digests["k8v4"], digests["k8v8"]}) == 4
    assert namespace_tag("fp8") == "fp8/2" and namespace_tag("lossless") == ""
    with pytest.raises(ValueError, match="kv_codec"):
        load_settings({"model_id": "m", "layout": layout, "kv_codec": "zip"})


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvt"))


@pytest.mark.parametrize("codec", ["lossless", "fp8", "k8v4", "k8v8"])
def test_the_store_writes_smaller_files_and_reads_them_back(tmp_path: Path, codec: str) -> None:
    layout = KVLayout(4, 2, 64, torch.bfloat16)
    tokens = list(range(512))
    kv = torch.randn(layout.shape(512)).to(torch.bfloat16)
    sizes = {}
    for name in ("none", codec):
        cfg = load_settings({"model_id": "m", "layout": layout, "host_bytes": 0, "disk_path": str(tmp_path / name),
                             "kv_codec": name})
        with TieredStore(cfg) as store:
            store.put(tokens, kv)
            store.flush()
        with TieredStore(cfg) as store:
            got = store.get(tokens)
            assert got is not None and got.shape == kv.shape
            assert store.tiers[0].metrics.snapshot().corrupt_chunks == 0
            if name in ("none", "lossless"):
                assert torch.equal(got, kv)
            else:
                assert (got.float() - kv.float()).abs().max() < 0.5
            assert store.tiers[0].metrics.snapshot().bytes > 0
        sizes[name] = sum(f.stat().st_size for f in chunk_files(tmp_path / name))
    assert sizes[codec] < sizes["none"] * (0.9 if codec == "lossless" else 0.55)


def test_a_chunk_of_an_unknown_codec_is_a_miss_and_stays_for_the_instances_that_read_it(tmp_path: Path) -> None:
    layout = KVLayout(2, 1, 64, torch.bfloat16)
    cfg = load_settings({"model_id": "m", "layout": layout, "host_bytes": 0, "disk_path": str(tmp_path),
                         "kv_codec": "lossless"})
    tokens = list(range(256))
    with TieredStore(cfg) as store:
        store.put(tokens, torch.randn(layout.shape(256)).to(torch.bfloat16))
        store.flush()
    (path,) = chunk_files(tmp_path)
    image = bytearray(path.read_bytes())
    header = unpack_header(bytes(image[:4096]))
    assert header.codec is not None
    image[HEADER_STRUCT_BYTES:HEADER_STRUCT_BYTES + 2] = (77).to_bytes(2, "little")  # a newer kvtier's codec
    record = bytes(image[HEADER_STRUCT_BYTES - 8:CODEC_RECORD_END - 8])
    image[CODEC_RECORD_END - 8:CODEC_RECORD_END] = _CHECK.pack(xxhash.xxh3_64_intdigest(record))
    path.write_bytes(bytes(image))
    with TieredStore(cfg) as store:
        with pytest.raises(KeyError, match="0 of 1"):
            store.get(tokens)
        assert store.tiers[0].metrics.snapshot().corrupt_chunks == 0
    assert path.exists()


def test_the_e4m3_table_decodes_every_code_as_torchs_float8_conversion() -> None:
    from kvtier.codec.quant import _e4m3

    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = _e4m3(codes)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("name", ["fp8", "k8v4", "k8v8"])
@pytest.mark.parametrize("geom", [*GEOMS, KVGeometry(5, 2, 16, 3, torch.bfloat16, interleaved=True)],
                         ids=["bf16-interleaved", "fp16-split", "fp32-odd", "bf16-odd-row"])
def test_decoding_a_few_layers_at_a_time_gives_the_whole_chunks_bytes(name: str, geom: KVGeometry,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of one layer, of two (a last group shorter), and the chunk whole decode alike; so
    does k8v4 with an odd count of 4-bit codes per layer (16 x 3 x 2 pages), which cannot be
    cut by layers."""
    from kvtier.codec import quant

    raw = kv_like(geom)
    stored, record = Encoder(CODECS[name], geom).encode(raw)
    outs = []
    for slice_bytes in (1 << 40, geom.raw_bytes // geom.layers, 2 * geom.raw_bytes // geom.layers):
        monkeypatch.setattr(quant, "SLICE_BYTES", slice_bytes)
        out = torch.full_like(raw, 0xAB)
        decode_into(record, stored, out)
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("name", ["fp8", "k8v4", "k8v8"])
@pytest.mark.parametrize("geom", [*GEOMS, KVGeometry(1, 2, 16, 8, torch.float32, interleaved=False)],
                         ids=["bf16-interleaved", "fp16-split", "fp32-odd", "fp32-one-layer-split"])
def test_encoding_leaves_the_chunk_as_it_was(name: str, geom: KVGeometry) -> None:
    """The encoders work in place on a copy of their own, also where the chunk is float32
    already (a ``.float()`` of it would be the chunk itself)."""
    raw = kv_like(geom)
    before = raw.clone()
    Encoder(CODECS[name], geom).encode(raw)
    assert torch.equal(raw, before)


def test_e4m3_by_moving_bits_is_every_codes_value_times_2_to_the_minus_8() -> None:
    """The decoder's float16 bit move against torch's own float8 conversion, subnormals and
    both zeros included; the NaN codes (never written) read as finite +-480 * 2**-8."""
    from kvtier.codec.quant import _e4m3_half

    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float() / 256
    got = _e4m3_half(codes).float()
    real = ~want.isnan()
    assert torch.equal(got[real], want[real])
    assert torch.equal(got[real].signbit(), want[real].signbit())
    assert got[~real].tolist() == [480 / 256, -480 / 256]


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: str(g.dtype))
@pytest.mark.parametrize("fill", [0x00, 0x7F, 0x80, 0xFF])
def test_an_fp8_payload_of_any_bytes_decodes_finite(fill: int, geom: KVGeometry) -> None:
    """A payload that passes its checksum is a neighbour's bytes: NaN codes, and exponents past
    the encoder's range (0x7F is +127), must still decode to finite KV in every dtype."""
    codec = CODECS["fp8"]
    kg, vg = codec.groups(geom)
    stored = torch.full((sum(codec.sizes(geom, kg, vg)),), fill, dtype=torch.uint8)
    out = torch.empty(geom.raw_bytes, dtype=torch.uint8)
    codec.decode(stored, geom, kg, vg, out)
    assert torch.isfinite(out.view(geom.dtype)).all()


def test_pool_verify_checks_coded_chunks_and_finds_them_whole(tmp_path: Path) -> None:
    from _pool import new_pool
    from kvtier import admin

    layout = KVLayout(2, 2, 64, torch.bfloat16)
    url = new_pool(tmp_path / "pool")
    cfg = load_settings({"model_id": "m", "layout": layout, "host_bytes": 0, "pool_url": url, "kv_codec": "fp8"})
    with TieredStore(cfg) as store:
        store.put(list(range(1024)), torch.randn(layout.shape(1024)).to(torch.bfloat16))
        store.flush()
    report = admin.verify(tmp_path / "pool")
    assert report.checked == 4 and report.ok == 4, report.bad
    (first, *_) = chunk_files(tmp_path / "pool")
    image = bytearray(first.read_bytes())
    image[5000] ^= 1  # a flipped bit in the stored (coded) payload
    first.write_bytes(bytes(image))
    report = admin.verify(tmp_path / "pool")
    assert [b["fault"] for b in report.bad] == ["payload_checksum"]


def test_auto_judges_a_tier_by_the_time_its_bytes_take_not_by_its_fastest_reads() -> None:
    """A tier whose reads are mostly slow stays coded when its last few reads hit the page
    cache: averaged as rates, three hits 50x faster outweighed forty device reads."""
    from kvtier.codec import CodecRates

    rates = CodecRates()
    rates.observe_decode(10**9, 1.0)  # 1 GB/s: coding pays below ~0.48 GB/s at 1.91x
    for _ in range(40):
        rates.observe_read(10**8, 1.0)  # 100 MB/s: a slow pool
    assert rates.worth_coding(1.91)
    for _ in range(3):
        rates.observe_read(5 * 10**9, 1.0)  # 5 GB/s: page-cache hits
    assert rates.worth_coding(1.91)
    for _ in range(40):
        rates.observe_read(5 * 10**9, 1.0)  # the tier is now served from memory: it learns that
    assert not rates.worth_coding(1.91)


def test_auto_codes_a_tier_only_while_its_measured_rates_say_decoding_pays(tmp_path: Path) -> None:
    """``auto`` shares k8v8's namespace; a slow tier (the defaults: a network filesystem's rate)
    gets k8v8 files, and once its reads are measured faster than decoding saves, the engine's
    bytes; a k8v8 instance reads both."""
    from kvtier.codec import CodecRates

    rates = CodecRates()
    assert rates.worth_coding(1.94)  # nothing measured: a network filesystem, one decoding core
    rates.observe_decode(10**9, 1.0)
    rates.observe_read(10**9, 0.1)  # 10 GB/s: a page cache
    assert not rates.worth_coding(1.94)
    layout = KVLayout(2, 2, 64, torch.bfloat16)
    cfg = {"model_id": "m", "layout": layout, "host_bytes": 0, "disk_path": str(tmp_path)}
    namespaces = {c: load_settings({**cfg, "kv_codec": c}).namespace().digest for c in ("auto", "k8v8")}
    assert namespaces["auto"] == namespaces["k8v8"]
    kv = torch.randn(layout.shape(512)).to(torch.bfloat16)
    with TieredStore(load_settings({**cfg, "kv_codec": "auto"})) as store:
        store.put(list(range(256)), kv[:, :, :256])
        store.flush()
        files = store.tiers[0].files  # type: ignore[attr-defined]
        files.codec_rates.observe_decode(10**9, 1.0)
        for _ in range(30):
            files.codec_rates.observe_read(10**9, 0.1)
        store.put(list(range(512)), kv)
        store.flush()
    sizes = sorted(f.stat().st_size for f in chunk_files(tmp_path))
    assert len(sizes) == 2 and sizes[0] < 0.6 * sizes[1]  # the first chunk coded, the second not
    with TieredStore(load_settings({**cfg, "kv_codec": "k8v8"})) as store:
        got = store.get(list(range(512)))
        assert torch.equal(got[:, :, 256:], kv[:, :, 256:])  # the uncoded chunk: exact
        assert (got[:, :, :256].float() - kv[:, :, :256].float()).abs().max() < 0.5

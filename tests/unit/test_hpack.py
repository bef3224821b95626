"""The HPACK decoder of the daemon's own HTTP/2 server: the RFC 7541 Appendix C examples (dynamic table
contents and sizes included), every field representation built by hand, Huffman strings, and the
malformed blocks that must each end in one short HpackError (never another exception)."""

from __future__ import annotations

import contextlib
import random

import pytest

from nodeagent.wire.hpack import _HUFFMAN_CODES as HUFFMAN_CODES
from nodeagent.wire.hpack import STATIC_TABLE, HpackDecoder, HpackError, encode_integer, huffman_decode

Field = tuple[bytes, bytes]


def unhex(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


def fields(*pairs: tuple[str, str]) -> list[Field]:
    return [(n.encode(), v.encode()) for n, v in pairs]


def table(decoder: HpackDecoder) -> list[tuple[str, str]]:
    return [(n.decode(), v.decode()) for n, v in decoder.dynamic_table]


# -- a tiny encoder for hand-built blocks ------------------------------------------------------------------


integer = encode_integer  # the encoding half of section 5.1 (also what the server uses)


def huffman_encode(data: bytes) -> bytes:
    acc, bits = 0, 0
    for octet in data:
        code, length = HUFFMAN_CODES[octet]
        acc = (acc << length) | code
        bits += length
    pad = -bits % 8
    acc = (acc << pad) | ((1 << pad) - 1)
    return acc.to_bytes((bits + pad) // 8, "big")


def string(data: bytes, huffman: bool = False) -> bytes:
    if huffman:
        data = huffman_encode(data)
        return integer(len(data), 7, 0x80) + data
    return integer(len(data), 7) + data


def indexed(index: int) -> bytes:
    return integer(index, 7, 0x80)


def literal(name: bytes | int, value: bytes, kind: str = "incremental", huffman: bool = False) -> bytes:
    prefix_bits, flags = {"incremental": (6, 0x40), "without": (4, 0x00), "never": (4, 0x10)}[kind]
    if isinstance(name, int):
        return integer(name, prefix_bits, flags) + string(value, huffman)
    return integer(0, prefix_bits, flags) + string(name, huffman) + string(value, huffman)


def size_update(size: int) -> bytes:
    return integer(size, 5, 0x20)


def error_of(decoder: HpackDecoder, block: bytes) -> str:
    with pytest.raises(HpackError) as info:
        decoder.decode(block)
    message = str(info.value)
    assert message and "\n" not in message and len(message) <= 200, message
    return message


# -- RFC 7541 Appendix C --------------------------------------------------------------------------------


def test_static_table_is_the_appendix_a_table() -> None:
    assert len(STATIC_TABLE) == 61
    assert STATIC_TABLE[0] == (b":authority", b"")
    assert STATIC_TABLE[1] == (b":method", b"GET")
    assert STATIC_TABLE[15] == (b"accept-encoding", b"gzip, deflate")
    assert STATIC_TABLE[60] == (b"www-authenticate", b"")
    decoder = HpackDecoder()
    assert decoder.decode(b"".join(indexed(i) for i in range(1, 62))) == list(STATIC_TABLE)


def test_c_1_integer_examples() -> None:
    assert integer(10, 5) == bytes((0b01010,))
    assert integer(1337, 5) == bytes((0b11111, 0b10011010, 0b00001010))
    assert integer(42, 8) == bytes((42,))
    # the 5-bit prefix of a size update, carrying the C.1.2 value
    decoder = HpackDecoder(max_table_size=4096)
    assert decoder.decode(size_update(1337)) == []
    assert decoder.dynamic_table_limit == 1337


def test_c_2_1_literal_with_indexing() -> None:
    decoder = HpackDecoder()
    block = unhex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572")
    assert decoder.decode(block) == fields(("custom-key", "custom-header"))
    assert table(decoder) == [("custom-key", "custom-header")]
    assert decoder.dynamic_table_size == 55


def test_c_2_2_literal_without_indexing() -> None:
    decoder = HpackDecoder()
    assert decoder.decode(unhex("040c 2f73 616d 706c 652f 7061 7468")) == fields((":path", "/sample/path"))
    assert table(decoder) == []
    assert decoder.dynamic_table_size == 0


def test_c_2_3_literal_never_indexed() -> None:
    decoder = HpackDecoder()
    block = unhex("1008 7061 7373 776f 7264 0673 6563 7265 74")
    assert decoder.decode(block) == fields(("password", "secret"))
    assert table(decoder) == []


def test_c_2_4_indexed() -> None:
    decoder = HpackDecoder()
    assert decoder.decode(unhex("82")) == fields((":method", "GET"))
    assert table(decoder) == []


REQUEST_1 = fields((":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"))
REQUEST_2 = [*REQUEST_1, (b"cache-control", b"no-cache")]
REQUEST_3 = fields(
    (":method", "GET"),
    (":scheme", "https"),
    (":path", "/index.html"),
    (":authority", "www.example.com"),
    ("custom-key", "custom-value"),
)
TABLE_1 = [(":authority", "www.example.com")]
TABLE_2 = [("cache-control", "no-cache"), *TABLE_1]
TABLE_3 = [("custom-key", "custom-value"), *TABLE_2]

C3_BLOCKS = (
    "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "8286 84be 5808 6e6f 2d63 6163 6865",
    "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
)
C4_BLOCKS = (
    "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
    "8286 84be 5886 a8eb 1064 9cbf",
    "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
)


@pytest.mark.parametrize("blocks", [C3_BLOCKS, C4_BLOCKS], ids=["C.3-plain", "C.4-huffman"])
def test_c_3_and_c_4_requests(blocks: tuple[str, str, str]) -> None:
    decoder = HpackDecoder()
    expected = [(REQUEST_1, TABLE_1, 57), (REQUEST_2, TABLE_2, 110), (REQUEST_3, TABLE_3, 164)]
    for block, (headers, entries, size) in zip(blocks, expected, strict=True):
        assert decoder.decode(unhex(block)) == headers
        assert table(decoder) == entries
        assert decoder.dynamic_table_size == size


DATE_1 = "Mon, 21 Oct 2013 20:13:21 GMT"
DATE_2 = "Mon, 21 Oct 2013 20:13:22 GMT"
COOKIE = "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
LOCATION = "https://www.example.com"
RESPONSE_1 = fields(
    (":status", "302"), ("cache-control", "private"), ("date", DATE_1), ("location", LOCATION)
)
RESPONSE_2 = [(b":status", b"307"), *RESPONSE_1[1:]]
RESPONSE_3 = fields(
    (":status", "200"),
    ("cache-control", "private"),
    ("date", DATE_2),
    ("location", LOCATION),
    ("content-encoding", "gzip"),
    ("set-cookie", COOKIE),
)
RTABLE_1 = [("location", LOCATION), ("date", DATE_1), ("cache-control", "private"), (":status", "302")]
RTABLE_2 = [(":status", "307"), ("location", LOCATION), ("date", DATE_1), ("cache-control", "private")]
RTABLE_3 = [("set-cookie", COOKIE), ("content-encoding", "gzip"), ("date", DATE_2)]

C5_BLOCKS = (
    """4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133
       2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70
       6c65 2e63 6f6d""",
    "4803 3330 37c1 c0bf",
    """88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d
       54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049
       5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e
       3d31""",
)
C6_BLOCKS = (
    """4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
       2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3""",
    "4883 640e ffc1 c0bf",
    """88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
       77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
       9587 3160 65c0 03ed 4ee5 b106 3d50 07""",
)


@pytest.mark.parametrize("blocks", [C5_BLOCKS, C6_BLOCKS], ids=["C.5-plain", "C.6-huffman"])
def test_c_5_and_c_6_responses_evict_at_256_octets(blocks: tuple[str, str, str]) -> None:
    # The examples assume SETTINGS_HEADER_TABLE_SIZE 256 from the start (no size update in the blocks):
    # the advertised maximum is also the table's initial size.
    decoder = HpackDecoder(max_table_size=256)
    assert decoder.dynamic_table_limit == 256
    expected = [(RESPONSE_1, RTABLE_1, 222), (RESPONSE_2, RTABLE_2, 222), (RESPONSE_3, RTABLE_3, 215)]
    for block, (headers, entries, size) in zip(blocks, expected, strict=True):
        assert decoder.decode(unhex(block)) == headers
        assert table(decoder) == entries
        assert decoder.dynamic_table_size == size


# -- Huffman --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("coded", "text"),
    [
        ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
        ("a8eb 1064 9cbf", "no-cache"),
        ("25a8 49e9 5ba9 7d7f", "custom-key"),
        ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
        ("6402", "302"),
        ("aec3 771a 4b", "private"),
        ("d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff", DATE_1),
        ("9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3", LOCATION),
        ("9bd9 ab", "gzip"),
        ("", ""),
    ],
)
def test_huffman_rfc_strings(coded: str, text: str) -> None:
    assert huffman_decode(unhex(coded)) == text.encode()
    assert huffman_encode(text.encode()) == unhex(coded)


def test_huffman_table_shape() -> None:
    assert len(HUFFMAN_CODES) == 257
    assert HUFFMAN_CODES[256] == (0x3FFFFFFF, 30)  # EOS
    assert HUFFMAN_CODES[ord("0")] == (0x0, 5)
    assert HUFFMAN_CODES[ord("a")] == (0x3, 5)
    assert min(length for _, length in HUFFMAN_CODES) == 5
    # a complete prefix code: the Kraft sum is exactly one
    assert sum(2 ** (30 - length) for _, length in HUFFMAN_CODES) == 2**30


def test_huffman_every_symbol_round_trips() -> None:
    every = bytes(range(256))
    assert huffman_decode(huffman_encode(every)) == every
    for octet in range(256):
        one = bytes((octet,))
        assert huffman_decode(huffman_encode(one)) == one
        assert huffman_decode(huffman_encode(one * 3)) == one * 3


def test_huffman_random_strings_round_trip() -> None:
    rng = random.Random(7541)
    for _ in range(500):
        data = rng.randbytes(rng.randrange(0, 80))
        assert huffman_decode(huffman_encode(data)) == data


def eos_string() -> bytes:
    code, length = HUFFMAN_CODES[256]
    bits = HUFFMAN_CODES[ord("a")][1] + length
    acc = (HUFFMAN_CODES[ord("a")][0] << length) | code
    pad = -bits % 8
    return ((acc << pad) | ((1 << pad) - 1)).to_bytes((bits + pad) // 8, "big")


def test_huffman_refuses_eos() -> None:
    with pytest.raises(HpackError, match="EOS"):
        huffman_decode(eos_string())
    with pytest.raises(HpackError, match="EOS"):
        huffman_decode(b"\xff\xff\xff\xff")  # 30 ones is EOS whatever follows


def test_huffman_refuses_bad_padding() -> None:
    # '0' is 00000: three padding bits of zeros instead of ones
    with pytest.raises(HpackError, match="not all ones"):
        huffman_decode(b"\x00")
    # 'a' (00011) then 111 is fine; 'a' then 110 is not
    assert huffman_decode(bytes((0b00011111,))) == b"a"
    with pytest.raises(HpackError, match="not all ones"):
        huffman_decode(bytes((0b00011110,)))
    # a whole octet of padding after a symbol ending on the octet boundary: 8 bits of padding
    eight = huffman_encode(b"aaaaaaaa")  # 40 bits, no padding
    assert len(eight) == 5
    assert huffman_decode(eight) == b"aaaaaaaa"
    with pytest.raises(HpackError, match="8 bits of padding"):
        huffman_decode(eight + b"\xff")
    # 'a' then 3 + 8 one bits
    with pytest.raises(HpackError, match="11 bits of padding"):
        huffman_decode(bytes((0b00011111, 0xFF)))


def test_huffman_in_a_block_and_cache() -> None:
    decoder = HpackDecoder()
    path = b"/v1beta1.DevicePlugin/Allocate"
    block = literal(4, path, kind="without", huffman=True)
    for _ in range(3):  # the second and third come from the cache
        assert decoder.decode(block) == [(b":path", path)]
    # the cache stays bounded however many distinct strings come by
    for i in range(600):
        assert decoder.decode(literal(b"n", b"%d" % i, kind="without", huffman=True)) == [(b"n", b"%d" % i)]
    assert len(decoder._cache) <= 256
    long_value = b"x" * 1000
    assert decoder.decode(literal(b"k", long_value, kind="without", huffman=True)) == [(b"k", long_value)]
    assert huffman_encode(long_value) not in decoder._cache


def test_bad_huffman_in_a_block() -> None:
    eos = eos_string()
    assert "EOS" in error_of(HpackDecoder(), bytes((0x04, 0x80 | len(eos))) + eos)
    assert "padding" in error_of(HpackDecoder(), bytes((0x04, 0x81, 0x00)))


# -- hand-built blocks ----------------------------------------------------------------------------------


def test_empty_block() -> None:
    assert HpackDecoder().decode(b"") == []


def test_all_representations_with_dynamic_names() -> None:
    decoder = HpackDecoder()
    block = b"".join(
        (
            literal(b"x-one", b"1"),  # -> 62
            literal(b"x-two", b"2", huffman=True),  # -> 62, x-one moves to 63
            indexed(62),
            indexed(63),
            literal(63, b"one again", kind="without"),
            literal(62, b"secret", kind="never"),
            literal(b"x-plain", b"v", kind="without"),
            literal(b"x-never", b"s", kind="never", huffman=True),
            literal(63, b"3"),  # name x-one, added as 62
        )
    )
    assert decoder.decode(block) == [
        (b"x-one", b"1"),
        (b"x-two", b"2"),
        (b"x-two", b"2"),
        (b"x-one", b"1"),
        (b"x-one", b"one again"),
        (b"x-two", b"secret"),
        (b"x-plain", b"v"),
        (b"x-never", b"s"),
        (b"x-one", b"3"),
    ]
    assert table(decoder) == [("x-one", "3"), ("x-two", "2"), ("x-one", "1")]
    assert decoder.dynamic_table_size == 3 * (5 + 1 + 32)


def test_integer_prefix_boundaries() -> None:
    decoder = HpackDecoder()
    # 126 / 127 / 128 octet strings: the 7-bit length prefix is full at 127
    for n in (126, 127, 128, 300):
        value = b"v" * n
        assert decoder.decode(literal(b"n", value, kind="without")) == [(b"n", value)]
    # index 15 (4-bit prefix full) and 63 (6-bit prefix full) and a dynamic index past 127
    assert decoder.decode(literal(15, b"x", kind="without")) == [(b"accept-charset", b"x")]
    for i in range(80):
        decoder.decode(literal(b"h%d" % i, b""))
    assert decoder.decode(literal(63, b"y", kind="without")) == [(b"h78", b"y")]
    assert decoder.decode(indexed(61 + 80)) == [(b"h0", b"")]
    assert decoder.decode(indexed(127)) == [(b"h14", b"")]
    assert decoder.decode(bytes((0xFF, 0x80, 0x00))) == [(b"h14", b"")]  # a redundant zero continuation


def test_size_update_evicts_and_limits_the_table() -> None:
    decoder = HpackDecoder()
    decoder.decode(literal(b"a", b"1") + literal(b"b", b"2") + literal(b"c", b"3"))
    assert decoder.dynamic_table_size == 3 * 34
    assert decoder.decode(size_update(70)) == []
    assert table(decoder) == [("c", "3"), ("b", "2")]
    assert decoder.dynamic_table_limit == 70
    # two updates at the start of one block (shrink, then grow) are both allowed
    assert decoder.decode(size_update(0) + size_update(100) + indexed(2)) == [(b":method", b"GET")]
    assert table(decoder) == []
    decoder.decode(literal(b"d", b"4") + literal(b"e", b"5") + literal(b"f", b"6"))
    assert table(decoder) == [("f", "6"), ("e", "5")]  # 100 octets hold two entries of 34
    assert "out of range (table has 63 entries)" in error_of(decoder, indexed(64))


def test_entry_larger_than_the_table_empties_it() -> None:
    decoder = HpackDecoder(max_table_size=100)
    decoder.decode(literal(b"a", b"1"))
    assert decoder.decode(literal(b"big", b"x" * 80)) == [(b"big", b"x" * 80)]
    assert table(decoder) == []
    assert decoder.dynamic_table_size == 0
    # exactly the table size fits
    assert decoder.decode(literal(b"k", b"v" * 67)) == [(b"k", b"v" * 67)]
    assert decoder.dynamic_table_size == 100


def test_zero_sized_table() -> None:
    decoder = HpackDecoder(max_table_size=0)
    assert decoder.decode(literal(b"a", b"1") + indexed(2)) == [(b"a", b"1"), (b":method", b"GET")]
    assert table(decoder) == []
    assert "index 62 is out of range (table has 61 entries)" in error_of(decoder, indexed(62))


def test_buffer_types() -> None:
    block = literal(b"k", b"v", huffman=True) + indexed(62)
    assert HpackDecoder().decode(bytearray(block)) == [(b"k", b"v"), (b"k", b"v")]  # type: ignore[arg-type]
    assert HpackDecoder().decode(memoryview(block)) == [(b"k", b"v"), (b"k", b"v")]  # type: ignore[arg-type]


def test_header_list_limit() -> None:
    value = b"v" * (100 - 32 - 1)  # name "k": exactly 100 octets counted
    block = literal(b"k", value, kind="without")
    assert HpackDecoder(max_header_list_size=100).decode(block) == [(b"k", value)]
    message = error_of(HpackDecoder(max_header_list_size=100), literal(b"k", value + b"v", kind="without"))
    assert "larger than 100" in message
    # the limit is over the whole list, indexed fields included
    decoder = HpackDecoder(max_header_list_size=16384)
    many = indexed(2) * (16384 // (7 + 3 + 32))
    assert len(decoder.decode(many)) == 390
    assert "larger than 16384" in error_of(decoder, many + indexed(2))


# -- errors ---------------------------------------------------------------------------------------------


def test_index_zero() -> None:
    assert "index 0" in error_of(HpackDecoder(), b"\x80")
    assert "index 0" not in error_of(HpackDecoder(), b"\x40\x00")  # index 0 there means a literal name


def test_index_out_of_range() -> None:
    message = error_of(HpackDecoder(), indexed(70))
    assert message == "header field index 70 is out of range (table has 61 entries)"
    decoder = HpackDecoder()
    decoder.decode(literal(b"a", b"1") + literal(b"b", b"2"))
    assert error_of(decoder, indexed(70)) == "header field index 70 is out of range (table has 63 entries)"
    assert "index 64" in error_of(HpackDecoder(), literal(64, b"v"))
    assert "index 99" in error_of(HpackDecoder(), literal(99, b"v", kind="never"))
    assert "index 1000" in error_of(HpackDecoder(), indexed(1000))


def test_size_update_above_the_maximum() -> None:
    assert "4097" in error_of(HpackDecoder(), size_update(4097))
    assert HpackDecoder().decode(size_update(4096)) == []
    assert "257" in error_of(HpackDecoder(max_table_size=256), size_update(257))


def test_size_update_after_a_field() -> None:
    assert "after a header field" in error_of(HpackDecoder(), indexed(2) + size_update(0))
    assert "after a header field" in error_of(HpackDecoder(), size_update(10) + indexed(2) + size_update(10))


@pytest.mark.parametrize(
    "block",
    [
        bytes((0x40,)),  # literal, nothing after
        bytes((0x40, 0x01, 0x61)),  # name but no value
        bytes((0x04,)),  # indexed name, no value
        bytes((0x10, 0x05, 0x61)),  # name shorter than announced
        bytes((0x04, 0x85, 0x61)),  # Huffman value shorter than announced
        bytes((0x04, 0x7F, 0x80, 0x01)) + b"v" * 100,  # 255 announced, 100 present
        bytes((0x04, 0x7F, 0xFF, 0xFF, 0xFF, 0x0F)),  # 2**28 + 126 announced
    ],
)
def test_truncated_string(block: bytes) -> None:
    message = error_of(HpackDecoder(), block)
    assert "string literal" in message


@pytest.mark.parametrize(
    "block", [b"\xff", b"\xff\x80", b"\xff\xff\xff", b"\x7f", b"\x3f\x81", b"\x0f", b"\x04\x7f"]
)
def test_truncated_integer(block: bytes) -> None:
    assert "inside an integer" in error_of(HpackDecoder(), block)


def test_over_long_integer() -> None:
    assert "continuation" in error_of(HpackDecoder(), b"\xff" + b"\x80" * 5 + b"\x01")
    assert "continuation" in error_of(HpackDecoder(), b"\x3f" + b"\xff" * 50)
    assert "too large" in error_of(HpackDecoder(), b"\xff\xff\xff\xff\xff\x7f")  # 35 bits
    assert "too large" in error_of(HpackDecoder(), b"\x04\x7f\xff\xff\xff\xff\x7f")


def test_random_blocks_raise_only_hpack_errors() -> None:
    rng = random.Random(20260401)
    outcomes = {"ok": 0, "error": 0}
    valid = [unhex(b) for b in (*C3_BLOCKS, *C4_BLOCKS, *C5_BLOCKS, *C6_BLOCKS)]
    for round_ in range(2000):
        decoder = HpackDecoder(max_table_size=rng.choice((0, 256, 4096)), max_header_list_size=4096)
        if round_ % 2:
            block = rng.randbytes(rng.randrange(0, 64))
        else:  # a valid block with a few octets changed: reaches deeper than noise
            mutated = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            block = bytes(mutated[: rng.randrange(1, len(mutated) + 1)])
        try:
            result = decoder.decode(block)
        except HpackError as e:
            assert str(e) and "\n" not in str(e) and len(str(e)) <= 200
            outcomes["error"] += 1
        else:
            assert all(isinstance(n, bytes) and isinstance(v, bytes) for n, v in result)
            outcomes["ok"] += 1
        with contextlib.suppress(HpackError):
            huffman_decode(block)
    assert outcomes["ok"] > 50 and outcomes["error"] > 50, outcomes

"""A record stream with corrupt bytes in the middle: each corrupt frame costs its own records only, every reader
names the file and the byte offset, and resynchronises on the next whole frame."""
from pathlib import Path

import pytest

import stream_child
from stream_child import mirrored_steps, written
from trainmon.read import stream_mirror
from trainmon.read.database import DbRankReader
from trainmon.writers import stream_format

FRAMES = 20  # meta, 18 batches, end
BATCHES = FRAMES - 2


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(stream_mirror.CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture
def stream(tmp_path) -> tuple[Path, bytes, stream_format.Frames]:
    path = tmp_path / "rank_0" / "records.stream"
    path.parent.mkdir()
    data = written(path, BATCHES)
    frames = stream_format.read_frames(path)
    assert len(frames.payloads) == FRAMES and frames.ends[-1] == len(data)
    return path, data, frames


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


def batch_steps(frames: stream_format.Frames) -> list[int]:
    return [stream_format.decode(p)[1].step for p in frames.payloads if bytes(p[:1]) == stream_format.BATCH]


def test_a_byte_flipped_at_every_offset_of_every_frame_costs_that_frame_only(stream):
    path, data, whole = stream
    payloads = [bytes(p) for p in whole.payloads]
    for hit, (start, end) in enumerate(zip(whole.starts, whole.ends)):
        others = payloads[:hit] + payloads[hit + 1:]
        for at in range(start, end):
            path.write_bytes(flipped(data, at))
            frames = stream_format.read_frames(path)
            assert [bytes(p) for p in frames.payloads] == others, (hit, at)
            if hit < FRAMES - 1:  # whole frames follow: the hit frame is a gap
                assert (frames.gaps, frames.tail, frames.end) == ([(start, end - start)], 0, len(data)), (hit, at)
            else:  # the end frame: nothing whole follows, so it is a tail, as a frame being written would be
                assert (frames.gaps, frames.tail, frames.end) == ([], end - start, start), (hit, at)


@pytest.mark.parametrize("place", ["magic", "length", "crc", "kind", "payload", "last byte"])
def test_every_reader_of_a_mirror_names_the_corrupt_frame_and_reads_every_other(stream, place):
    path, data, whole = stream
    offset_in_frame = {"magic": 1, "length": 5, "crc": 9, "kind": 12, "payload": 40, "last byte": -1}[place]
    steps = batch_steps(whole)
    for hit, (start, end) in enumerate(zip(whole.starts, whole.ends)):
        path.write_bytes(flipped(data, (end if offset_in_frame < 0 else start) + offset_in_frame))
        lost_step = [steps[hit - 1]] if 0 < hit < FRAMES - 1 else []
        assert mirrored_steps(path) == [s for s in steps if s not in lost_step], (place, hit)
        found = stream_mirror.findings(path)
        if hit < FRAMES - 1:
            assert len(found.lost) == 1 and f"{end - start} bytes at offset {start} are not a whole frame" in \
                found.lost[0] and str(path) in found.lost[0], found
            assert found.ended and found.tail is None
        else:
            assert found.lost == [] and not found.ended
            assert f"{path}: its last {end - start} bytes, from offset {start}, are not a whole" in found.tail
        reader = DbRankReader(stream_mirror.mirror_path(path))
        try:
            assert ("ops" in reader.meta) == (hit != 0), "the metadata frame is the only one that holds it"
        finally:
            reader.close()
        stream_mirror.mirror_path(path).unlink()  # the next case is another file at this path


def test_a_tag_is_named_by_the_batch_that_first_uses_it_and_again_by_the_next_only(stream):
    _, _, whole = stream
    batches = [stream_format.decode(p)[1] for p in whole.payloads if bytes(p[:1]) == stream_format.BATCH]
    named = [[tag[2] for tag in batch.tags] for batch in batches]
    again = [[tag[2] for tag in batch.tags_again] for batch in batches]
    keys = [key.name for key in stream_child.KEYS]
    assert named == [keys] + [[]] * (BATCHES - 1), "`tags` as an earlier reader reads it: each tag once"
    assert again == [[], keys] + [[]] * (BATCHES - 2)


def test_two_frames_lost_in_a_row_take_the_names_of_later_records_with_them_and_say_so(stream):
    path, data, whole = stream
    # the first two batches both name the tags (the second again): when both are lost, later records have none
    damaged = bytearray(data)
    for hit in (1, 2):
        damaged[whole.starts[hit] + 20] ^= 0xFF
    path.write_bytes(bytes(damaged))
    reader = DbRankReader(stream_mirror.sync(path))
    try:
        assert list(reader.rows(None, None, None)) == [], "no record of a later step can be named"
        assert reader.steps() == set(range(2, BATCHES)), "their steps and scalars are read"
        assert len(reader.scalars("loss", None, None)) == BATCHES - 2
    finally:
        reader.close()
    found = stream_mirror.findings(path)
    assert f"{whole.ends[2] - whole.starts[1]} bytes at offset {whole.starts[1]} are not" in found.lost[0], "one gap"
    assert len(found.lost) == 5, "the gap, three frames named, the others counted"
    assert found.lost[1] == f"{path}: the frame at offset {whole.starts[3]}: step 2: 2 of its 2 records name tags " \
                            "that only unreadable frames define; not read"
    assert found.lost[4] == f"{path}: {BATCHES - 5} more frames not read whole, the last at offset {whole.starts[-2]}"
    # one lost batch: the next one names the tags again, and every later record is read
    path.write_bytes(flipped(data, whole.starts[1] + 20))
    stream_mirror.mirror_path(path).unlink()
    assert mirrored_steps(path) == list(range(1, BATCHES))


def test_a_whole_frame_whose_content_is_not_ours_is_named_and_skipped(stream):
    path, data, whole = stream
    foreign = stream_format.frame(stream_format.BATCH, b"\x05\x00\x00\x00{not json")
    at = whole.starts[5]
    path.write_bytes(data[:at] + foreign + data[at:])
    assert mirrored_steps(path) == list(range(BATCHES))
    found = stream_mirror.findings(path)
    assert len(found.lost) == 1 and found.lost[0].startswith(f"{path}: the frame at offset {at}: not readable (")


def test_zeros_between_whole_frames_are_read_again_until_their_frame_arrives(stream):
    """What a network filesystem may show of a frame whose pages reach the server after later ones."""
    path, data, whole = stream
    start, end = whole.starts[4], whole.ends[4]
    path.write_bytes(data[:start] + bytes(end - start) + data[end:])
    assert mirrored_steps(path) == [s for s in range(BATCHES) if s != 3]
    assert f"{end - start} bytes at offset {start}" in stream_mirror.findings(path).lost[0]
    path.write_bytes(data)
    assert sorted(mirrored_steps(path, in_order=False)) == list(range(BATCHES))
    found = stream_mirror.findings(path)
    assert (found.lost, found.tail, found.ended) == ([], None, True)


def test_bytes_after_the_end_frame_are_named_as_such_not_as_a_job_still_writing(stream):
    path, data, whole = stream
    path.write_bytes(data + b"\x00junk after the end" * 3)
    assert mirrored_steps(path) == list(range(BATCHES))
    found = stream_mirror.findings(path)
    assert found.lost == [] and found.ended
    assert found.tail == f"{path}: 57 bytes after its end frame, at offset {len(data)}, are not a frame; ignored"

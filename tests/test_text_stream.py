"""`decode.TextStream`: a completion's text as its tokens arrive, in whole characters, cut
at the first stop string, and never showing the start of a stop string too early."""

import pytest

from purejax import decode

# A toy byte-level tokenizer: id i is byte i; decoding replaces a broken character by U+FFFD.
decode_bytes = lambda ids: bytes(ids).decode("utf-8", errors="replace")


def stream_all(pieces, stop=()):
  """Pushes each piece (a list of ids); returns what each push showed, and the rest."""
  stream = decode.TextStream(decode_bytes, stop)
  shown = [stream.push(piece) for piece in pieces]
  return shown, stream.finish(), stream


def test_a_character_is_shown_only_once_all_its_bytes_arrived():
  snowman = list("☃".encode("utf-8"))  # three bytes
  shown, rest, _ = stream_all([[ord("a")], snowman[:1], snowman[1:2], snowman[2:] + [ord("b")]])
  assert shown == ["a", "", "", "☃b"] and rest == ""
  assert "\ufffd" not in "".join(shown)


def test_the_text_stops_before_a_stop_string_that_spans_pushes():
  text = "Hello.\n\nUser: next"
  shown, rest, stream = stream_all([list(text[i:i + 3].encode()) for i in range(0, len(text), 3)],
                                   stop=["\n\nUser:"])
  assert "".join(shown) + rest == "Hello."
  assert stream.stopped and stream.text == "Hello."
  assert stream.push(list(b"more")) == ""  # nothing after a stop


def test_a_possible_start_of_a_stop_string_waits_until_it_is_not_one():
  shown, rest, stream = stream_all([list(b"ab##"), list(b"#"), list(b"c")], stop=["###!"])
  # "##" and then "###" could begin "###!": held back until "c" shows it is not one.
  assert shown == ["ab", "", "###c"] and rest == "" and not stream.stopped


def test_without_stop_strings_finish_gives_whatever_is_held():
  shown, rest, _ = stream_all([list(b"x"), list("é".encode())[:1]])
  assert shown == ["x", ""] and rest == "\ufffd"  # a character that never completed


@pytest.mark.parametrize("stops,want", [(["b", "bc"], "a"), (["cd", "b"], "a"), ([""], "abcd")])
def test_the_first_stop_string_in_the_text_wins(stops, want):
  shown, rest, _ = stream_all([list(b"abcd")], stop=stops)
  assert "".join(shown) + rest == want

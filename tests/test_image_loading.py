"""Every accepted image_data form decodes to the same image; every refused one is an ImageInputError naming
the field."""

from __future__ import annotations

import base64
import dataclasses
import os

import pytest
from PIL import Image

from sglang.srt.managers.generate_input import GenerateReqInput
from sglang.srt.multimodal.image_loading import ImageInputError, ImageLimits, load_image_input
from tests.vlm_fixtures import noise_image, png_bytes

LIMITS = ImageLimits(max_bytes=100_000, max_pixels=200 * 200)


@pytest.fixture
def picture():
    return noise_image(40, 30, seed=1)


def test_every_accepted_form_decodes_to_the_same_pixels(picture, tmp_path):
    data = png_bytes(picture)
    path = tmp_path / "p.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [picture, data, str(path), f"file://{path}", b64, f"data:image/png;base64,{b64}",
             {"url": f"data:image/png;base64,{b64}"}]
    local = dataclasses.replace(LIMITS, local_media_root=os.path.realpath(tmp_path))
    for form in forms:
        loaded = load_image_input(form, local)
        assert loaded.size == (40, 30)
        assert loaded.convert("RGB").tobytes() == picture.tobytes(), type(form)


@pytest.mark.parametrize("item, message", [
    (b"not an image at all", "cannot identify an image"),
    ("@@@", "not a readable file path"),
    ("data:image/png,rawtext", "only base64 data URIs"),
    (12, "unsupported image input of type int"),
    ({"path": "x"}, "must have a string 'url'"),
    ("https://example.com/cat.png", "host 'example.com' is not allowed"),
])
def test_refused_inputs_name_the_field(item, message):
    with pytest.raises(ImageInputError, match="^image_data\\[2\\]: ") as info:
        load_image_input(item, LIMITS, "image_data[2]")
    assert message in str(info.value)


def test_local_files_are_read_only_inside_the_allowed_folder(picture, tmp_path):
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    (other / "p.png").write_bytes(png_bytes(picture))
    (allowed / "link.png").symlink_to(other / "p.png")
    local = dataclasses.replace(LIMITS, local_media_root=os.path.realpath(allowed))
    for outside in (str(other / "p.png"), str(allowed / ".." / "other" / "p.png"), str(allowed / "link.png")):
        with pytest.raises(ImageInputError, match="outside --allowed-local-media-path"):
            load_image_input(outside, local)
    # Without an allowed folder nothing is read from disk; a path is just not valid base64.
    with pytest.raises(ImageInputError, match="not a readable file path"):
        load_image_input(str(other / "p.png"), LIMITS)
    with pytest.raises(ImageInputError, match="local files are not readable"):
        load_image_input(f"file://{other / 'p.png'}", LIMITS)


def test_size_limits_apply_before_decoding(tmp_path):
    big = Image.new("RGB", (300, 300), "blue")
    with pytest.raises(ImageInputError, match="300x300 pixels is over the limit of 40000 pixels"):
        load_image_input(png_bytes(big), LIMITS)
    with pytest.raises(ImageInputError, match="300x300 pixels"):
        load_image_input(big, LIMITS)
    with pytest.raises(ImageInputError, match="over the limit of 100000"):
        load_image_input(b"\0" * 100_001, LIMITS)


def test_url_allow_list_matches_domains_and_subdomains(monkeypatch):
    monkeypatch.setenv("SGLANG_ALLOWED_IMAGE_URL_DOMAINS", "images.example.org")
    limits = ImageLimits.from_server_args(type("Args", (), {"allowed_image_url_domains": "Example.com"})())
    assert limits.allowed_domains == ("example.com", "images.example.org")
    assert limits.domain_allowed("cdn.example.com") and limits.domain_allowed("images.example.org")
    assert not limits.domain_allowed("example.com.evil.net") and not limits.domain_allowed("org")


def test_image_data_is_split_per_prompt():
    one = GenerateReqInput(text="a", image_data="x").expand()
    assert one[0].image_data == "x"
    several = GenerateReqInput(text="a", image_data=["x", "y"]).expand()
    assert several[0].image_data == ["x", "y"]
    batch = GenerateReqInput(text=["a", "b"], image_data=[["x", "y"], "z"]).expand()
    assert [b.image_data for b in batch] == [["x", "y"], "z"]
    with pytest.raises(ValueError, match="The length of image_data should be equal to the batch size."):
        GenerateReqInput(text=["a", "b"], image_data=["x"]).expand()

"""ImageNet folders, CLIP preprocessing and the model-soups split, on a tiny generated ImageNet."""
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from companion.assets import AssetError, MissingAssetsError
from companion.assets.imagenet import ImageNetAssets, clip_preprocess
from companion.assets.manifest import DEFAULT_MANIFEST
from companion.params import load_yaml

WNIDS = ["n01440764", "n01443537", "n01484850"]  # sorted, as ImageFolder orders classes
N_TRAIN = 5  # per class
N_VAL = 2


def tiny_manifest(tmp_path: Path) -> Path:
    """The real manifest with the class count of the tiny ImageNet."""
    raw = load_yaml(DEFAULT_MANIFEST.read_text())
    for entry in raw["groups"]["imagenet"]["files"]:
        if entry.get("kind") == "image_folder":
            entry["classes"] = len(WNIDS)
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def image(rng, size, mode="RGB"):
    arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    return img.convert(mode)


@pytest.fixture()
def tiny(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "paper"
    for c, wnid in enumerate(WNIDS):
        for j in range(N_TRAIN):
            d = root / "imagenet" / "train" / wnid
            d.mkdir(parents=True, exist_ok=True)
            size = (40 + 7 * j, 30 + 5 * c)  # non-square, varied
            mode = "L" if j == 1 else "RGB"  # a greyscale JPEG, as some ImageNet files are
            ext = ".png" if j == 4 else ".JPEG"
            image(rng, size, mode).save(d / f"{wnid}_{j}{ext}")
        for j in range(N_VAL):
            d = root / "imagenet" / "val" / wnid
            d.mkdir(parents=True, exist_ok=True)
            image(rng, (64, 48)).save(d / f"ILSVRC2012_val_{c * N_VAL + j:08d}.JPEG")
    mask = np.zeros(len(WNIDS) * N_TRAIN, dtype=np.int64)
    mask[[2, 9, 13]] = 1  # held out
    np.save(root / "imagenet" / "imagenet_98_idxs.npy", mask)
    return root, tiny_manifest(tmp_path), mask


def manual_clip_preprocess(img: Image.Image, size: int = 224) -> torch.Tensor:
    """Bicubic resize of the shorter side, centre crop, RGB, OpenAI normalisation (written out)."""
    w, h = img.size
    if w <= h:
        new = (size, int(size * h / w))
    else:
        new = (int(size * w / h), size)
    img = img.resize(new, Image.BICUBIC)
    left = int(round((new[0] - size) / 2.0))
    top = int(round((new[1] - size) / 2.0))
    img = img.crop((left, top, left + size, top + size)).convert("RGB")
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
    return (x - mean) / std


def test_clip_preprocessing_is_clips_evaluation_transform():
    rng = np.random.default_rng(3)
    tf = clip_preprocess(224)
    for size, mode in [((300, 200), "RGB"), ((180, 260), "L"), ((224, 224), "RGB")]:
        img = image(rng, size, mode)
        x = tf(img)
        assert x.shape == (3, 224, 224) and x.dtype == torch.float32
        torch.testing.assert_close(x, manual_clip_preprocess(img), rtol=0, atol=1e-5)


def test_folders_labels_and_the_split(tiny):
    root, manifest, mask = tiny
    inet = ImageNetAssets(root, manifest=manifest)
    assert inet.train.classes == WNIDS and len(inet.train) == len(WNIDS) * N_TRAIN
    assert len(inet.val) == len(WNIDS) * N_VAL
    # ImageFolder order: class folders sorted, files sorted within; label = class position
    paths = [Path(p).name for p, _ in inet.train.samples]
    assert paths[:N_TRAIN] == sorted(paths[:N_TRAIN]) and paths[0].startswith(WNIDS[0])
    assert [t for _, t in inet.train.samples] == [c for c in range(3) for _ in range(N_TRAIN)]
    np.testing.assert_array_equal(inet.heldout_indices(), [2, 9, 13])
    np.testing.assert_array_equal(inet.fit_indices(), np.setdiff1d(np.arange(15), [2, 9, 13]))


def test_sharpness_images_are_drawn_deterministically_from_the_training_split(tiny):
    root, manifest, _ = tiny
    inet = ImageNetAssets(root, manifest=manifest)
    a = inet.sharpness_indices(6, seed=0)
    assert len(set(a.tolist())) == 6 and set(a.tolist()) <= set(inet.fit_indices().tolist())
    np.testing.assert_array_equal(a, inet.sharpness_indices(6, seed=0))
    assert not np.array_equal(a, inet.sharpness_indices(6, seed=1))
    assert sorted(inet.sharpness_indices(12, seed=5).tolist()) == inet.fit_indices().tolist()
    with pytest.raises(ValueError, match="between 1 and 12"):
        inet.sharpness_indices(13)
    batches = inet.sharpness_batches(n_images=6, batch_size=4, seed=0)
    assert [tuple(x.shape) for x, _ in batches] == [(4, 3, 224, 224), (2, 3, 224, 224)]
    labels = torch.cat([y for _, y in batches])
    assert labels.tolist() == [inet.train.samples[i][1] for i in a]
    # the pixels are the preprocessed files themselves, in the drawn order
    first = manual_clip_preprocess(Image.open(inet.train.samples[a[0]][0]))
    torch.testing.assert_close(batches[0][0][0], first, rtol=0, atol=1e-5)
    # the paper's defaults come from the manifest: 2048 images in batches of 256
    assert inet.settings["n_images"] == 2048 and inet.settings["batch_size"] == 256


def test_error_indices_and_loader(tiny):
    root, manifest, _ = tiny
    inet = ImageNetAssets(root, manifest=manifest)
    assert inet.error_indices("train").tolist() == inet.fit_indices().tolist()
    sub = inet.error_indices("train", n_images=4, seed=0)
    assert len(sub) == 4 and set(sub.tolist()) <= set(inet.fit_indices().tolist())
    assert inet.error_indices("val").tolist() == list(range(6))
    xs, ys = next(iter(inet.loader("val", batch_size=6, num_workers=0)))
    assert xs.shape == (6, 3, 224, 224) and ys.tolist() == [0, 0, 1, 1, 2, 2]


def test_a_mask_for_another_training_set_is_rejected(tiny):
    root, manifest, _ = tiny
    np.save(root / "imagenet" / "imagenet_98_idxs.npy", np.zeros(1281167, dtype=np.int64))
    inet = ImageNetAssets(root, manifest=manifest)
    with pytest.raises(AssetError, match="has 1281167 entries but .* holds 15 images"):
        inet.fit_indices()
    np.save(root / "imagenet" / "imagenet_98_idxs.npy", np.full(15, 2))
    with pytest.raises(AssetError, match="only 0/1 entries"):
        ImageNetAssets(root, manifest=manifest).fit_indices()


def test_missing_folders_raise_the_one_error(tiny):
    root, manifest, _ = tiny
    import shutil

    shutil.rmtree(root / "imagenet" / "val")
    with pytest.raises(MissingAssetsError) as info:
        ImageNetAssets(root, manifest=manifest)
    assert str(root / "imagenet" / "val") in str(info.value)
    assert "imagenet/train" not in str(info.value)

"""The demo dataset is a pure, balanced, class-conditional function of (seed, index)."""

from __future__ import annotations

import numpy as np

from runtime.demo.dataset import (CLASS_NAMES, IMAGE_SIZE, NUM_CLASSES, dataset_hash, from_tensor_range,
                                  labels_for, make_images, to_tensor_range)


def test_images_are_uint8_rgb_64x64_with_labels():
    images, labels = make_images(0, np.arange(30))
    assert images.shape == (30, IMAGE_SIZE, IMAGE_SIZE, 3) and images.dtype == np.uint8
    assert labels.shape == (30,) and labels.dtype == np.int64
    assert IMAGE_SIZE == 64


def test_same_seed_and_indices_give_identical_bytes():
    a, la = make_images(7, np.arange(40))
    b, lb = make_images(7, np.arange(40))
    assert a.tobytes() == b.tobytes() and (la == lb).all()


def test_a_sample_does_not_depend_on_what_is_rendered_with_it():
    full, full_labels = make_images(3, np.arange(50))
    picked, picked_labels = make_images(3, [41, 5, 17])
    assert picked.tobytes() == full[[41, 5, 17]].tobytes()
    assert (picked_labels == full_labels[[41, 5, 17]]).all()
    # Crossing the renderer's internal chunk boundary changes nothing either.
    far, _ = make_images(3, [1023, 1024, 1025])
    around, _ = make_images(3, np.arange(1020, 1030))
    assert far.tobytes() == around[3:6].tobytes()


def test_different_seeds_give_different_images_with_the_same_labels():
    a, la = make_images(0, np.arange(24))
    b, lb = make_images(1, np.arange(24))
    assert (la == lb).all()
    differs = [(a[i] != b[i]).any() for i in range(24)]
    assert all(differs)


def test_at_least_ten_named_classes():
    assert NUM_CLASSES >= 10
    assert len(CLASS_NAMES) == NUM_CLASSES == len(set(CLASS_NAMES))


def test_classes_are_balanced_over_any_run_of_num_classes_indices():
    labels = labels_for(np.arange(100, 100 + 5 * NUM_CLASSES))
    assert (np.bincount(labels, minlength=NUM_CLASSES) == 5).all()


def test_every_image_has_structure_and_varies_within_its_class():
    images, labels = make_images(0, np.arange(4 * NUM_CLASSES))
    flat = images.reshape(len(images), -1, 3).astype(np.float32)
    # Two colours plus noise: the per-image spread is far above the pixel noise alone.
    assert (flat.std(axis=1).max(axis=1) > 20).mean() > 0.9
    for c in range(NUM_CLASSES):
        same = images[labels == c]
        assert not (same[0] == same[1]).all(), CLASS_NAMES[c]


def test_pixel_noise_makes_flat_regions_vary():
    images, _ = make_images(0, np.arange(NUM_CLASSES))
    corner = images[:, :4, :4].reshape(NUM_CLASSES, -1).astype(np.float32)
    assert (corner.std(axis=1) > 0).all()


def test_dataset_hash_is_stable_and_sensitive_to_seed_and_size():
    h = dataset_hash(0, 30)
    assert h == dataset_hash(0, 30) and len(h) == 64
    assert h != dataset_hash(1, 30)
    assert h != dataset_hash(0, 31)


def test_tensor_range_round_trip_is_exact():
    images, _ = make_images(0, np.arange(4))
    x = to_tensor_range(images)
    assert x.shape == (4, 3, 64, 64) and x.min() >= -1 and x.max() <= 1
    assert (from_tensor_range(x) == images).all()

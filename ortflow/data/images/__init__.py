"""Image classification data: the embedded shapes (`data=images`, embedded.py) and a folder of the user's images in
torchvision's ImageFolder layout (`data=image_folder`, folder.py). Both use the same transforms from config
(transforms.py, torchvision's vocabulary) and the same loaders (loaders.py): a training order and per-sample
augmentation seeds drawn from one seeded generator, so a resumed run and every accel mode see the same batches."""

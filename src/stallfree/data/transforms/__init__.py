"""The torch backend's per-sample work: decode (decode: the fast JPEG path and PIL), the train and
val transforms (augment) and the auto-augment policies (policies: RandAugment, TrivialAugment)."""

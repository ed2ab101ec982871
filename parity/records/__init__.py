"""A recorded side: one side's battery results kept on disk, to prove the other side against once
the first is deleted (docs/after-linen.md).

`record(pair, out)` writes the Linen side's results (`environment`: what determines their bits;
`files`: the record's files; `writing`: what is recorded); `recorded(DIR)` (`side`) stands for the
deleted side in a pair, and the battery's parts compare the live side with it (`checks`)."""

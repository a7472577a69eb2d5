/* The embedded corpus: data/corpus.inc as read-only bytes between two symbols. */
    .section .rodata
    .global remat_corpus_begin
    .global remat_corpus_end
    .balign 16
remat_corpus_begin:
    .incbin "data/corpus.inc"
remat_corpus_end:
    .byte 0
    .section .note.GNU-stack,"",@progbits

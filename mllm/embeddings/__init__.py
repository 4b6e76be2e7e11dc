"""The word-embedding family: word2vec's CBOW, trained on the contexts inside each paragraph."""

"""Looking inside a network before it trains: what each node is made of (`architecture`,
`traced`, `kind_of`), how it behaves at initialisation (`probe`), and cheap scores for
comparing candidates (`proxies`)."""

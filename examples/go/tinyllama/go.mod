module tinyllama

go 1.19

require llmdiff/writers/llmdump v0.0.0

replace llmdiff/writers/llmdump => ../../../writers/go/llmdump

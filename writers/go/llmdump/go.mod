module llmdiff/writers/llmdump

go 1.19

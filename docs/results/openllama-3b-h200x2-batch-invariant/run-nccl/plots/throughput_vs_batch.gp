set terminal pngcairo size 900,600 font 'Sans,10'
set output 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/throughput_vs_batch.png'
set title 'Throughput'
set xlabel 'batch size (requests in flight)'
set ylabel 'generated tokens/s'
set grid
set logscale x 2
set key top left
plot 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_load.dat' index 0 using 1:2 with linespoints lw 2 pt 7 title 'nodes=1', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_load.dat' index 1 using 1:2 with linespoints lw 2 pt 7 title 'nodes=2'

set terminal pngcairo size 900,600 font 'Sans,10'
set output 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/latency_vs_batch.png'
set title 'Latency (p50)'
set xlabel 'batch size (requests in flight)'
set ylabel 'milliseconds'
set grid
set logscale x 2
set key top left
plot 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_load.dat' index 0 using 1:3 with linespoints lw 2 pt 7 title 'TTFT nodes=1', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_load.dat' index 0 using 1:4 with linespoints lw 2 pt 5 dt 2 title 'ITL nodes=1', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_load.dat' index 1 using 1:3 with linespoints lw 2 pt 7 title 'TTFT nodes=2', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_load.dat' index 1 using 1:4 with linespoints lw 2 pt 5 dt 2 title 'ITL nodes=2'
